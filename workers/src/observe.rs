//! What the dispatchers report to the metrics (`tollgate::metrics`) about each provider
//! call: one call per attempt from the dispatcher, the arithmetic here.

use tollgate::metrics;
use tollgate::model::Job;
use tollgate::retry::FailureClass;
use tollgate::routing::Target;

use crate::providers::CallOutcome;

/// The metrics label of a failure class.
pub fn class_label(class: FailureClass) -> &'static str {
    match class {
        FailureClass::Capacity => "capacity",
        FailureClass::Overload => "overload",
        FailureClass::KeyUnusable => "key_unusable",
        FailureClass::SpendCap => "spend_cap",
        FailureClass::Request => "request",
        FailureClass::Network => "network",
        FailureClass::Timeout => "timeout",
    }
}

/// One provider call's response: its status and class, throttling and Retry-After, and —
/// when it succeeded — estimated against reported tokens.
pub fn provider_call(job: &Job, target: &Target, outcome: &CallOutcome) {
    let failure = outcome.result.as_ref().err();
    metrics::provider_response(
        &target.provider,
        &target.model,
        outcome.status,
        failure.map(|f| class_label(f.class)),
        failure.and_then(|f| f.retry_after),
    );
    if let Ok(success) = &outcome.result {
        metrics::tokens(
            &target.provider,
            &target.model,
            job.endpoint,
            (
                i64::from(job.estimated_input_tokens),
                i64::from(job.estimated_output_tokens),
            ),
            (success.usage.input_tokens, success.usage.output_tokens),
        );
        metrics::job_finished(&job.tenant, job.class, "succeeded", "", job.attempt);
    }
}
