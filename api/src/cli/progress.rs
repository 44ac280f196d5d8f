//! What `tollgate submit --wait` shows while it follows its jobs: one count of finished
//! jobs, which both the bar's position and its message come from (so they cannot
//! disagree), and an ETA: the broker's forecast for the queues that hold the jobs, or
//! until it has one, the rate at which the jobs have actually finished.
//!
//! indicatif's own `{eta}` extrapolates from the bar's steps: it said "0s" before any
//! job had finished and swung to minutes after a pause. Here there is no ETA until the
//! broker forecasts one or a job has finished since following began; then it is
//! `remaining ÷ (finished ÷ elapsed)`.

use std::time::Duration;

/// Counts of the jobs of one `submit`, by how they ended.
#[derive(Debug, Clone, Default)]
pub(crate) struct Progress {
    /// Lines submitted (accepted or not).
    pub(crate) total: u64,
    pub(crate) succeeded: u64,
    /// Failed or cancelled.
    pub(crate) failed: u64,
    /// Refused at submission.
    pub(crate) rejected: u64,
    /// Finished before following began (refused, or already done): not part of the rate.
    baseline: u64,
    /// The broker's forecast of when the queues holding the jobs will have drained
    /// (`/v1/status` `eta_secs`), when it has one.
    pub(crate) forecast: Option<Duration>,
}

impl Progress {
    /// `total` lines, with the final `states` known when following begins.
    pub(crate) fn new<'a>(total: u64, states: impl IntoIterator<Item = &'a str>) -> Self {
        let mut p = Self {
            total,
            ..Self::default()
        };
        for state in states {
            p.record(state);
        }
        p.baseline = p.finished();
        p
    }

    /// A job reached `state`; states that are not final count for nothing.
    pub(crate) fn record(&mut self, state: &str) {
        match state {
            "succeeded" => self.succeeded += 1,
            "failed" | "cancelled" => self.failed += 1,
            "rejected" => self.rejected += 1,
            _ => {}
        }
    }

    /// Jobs finished, however: the bar's position.
    pub(crate) fn finished(&self) -> u64 {
        self.succeeded + self.failed + self.rejected
    }

    /// Time left: the broker's forecast, or else at the rate jobs have finished over the
    /// `elapsed` time since following began; `None` until there is either.
    pub(crate) fn eta(&self, elapsed: Duration) -> Option<Duration> {
        if self.forecast.is_some() {
            return self.forecast;
        }
        let measured = self.finished().saturating_sub(self.baseline);
        if measured == 0 || elapsed.is_zero() {
            return None;
        }
        let remaining = self.total.saturating_sub(self.finished());
        let nanos = elapsed.as_nanos() * u128::from(remaining) / u128::from(measured);
        Some(Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)))
    }

    /// The bar's message: the finished count (the bar's position; the bar shows no count
    /// of its own, so none can lag behind this one) and how they ended, then the ETA
    /// when there is one.
    pub(crate) fn message(&self, elapsed: Duration) -> String {
        let mut m = format!(
            "{}/{} done: {} succeeded, {} failed",
            self.finished(),
            self.total,
            self.succeeded,
            self.failed
        );
        if self.rejected > 0 {
            m.push_str(&format!(", {} rejected", self.rejected));
        }
        if let Some(eta) = self.eta(elapsed).filter(|_| self.finished() < self.total) {
            m.push_str(&format!(", ETA {}", short_duration(eta)));
        }
        m
    }
}

/// `45s`, `2m05s`, `3h07m`.
pub(crate) fn short_duration(d: Duration) -> String {
    let s = d.as_secs_f64().round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn no_eta_until_a_job_has_finished() {
        let p = Progress::new(30, ["queued"; 30]);
        assert_eq!(p.eta(Duration::ZERO), None);
        assert_eq!(p.eta(10 * SEC), None);
        assert_eq!(p.message(10 * SEC), "0/30 done: 0 succeeded, 0 failed");
        // Refused lines finished before following began: they are no rate either.
        let p = Progress::new(3, ["rejected", "queued", "queued"]);
        assert_eq!(p.eta(10 * SEC), None);
    }

    #[test]
    fn the_broker_s_forecast_is_the_eta_when_it_has_one() {
        let mut p = Progress::new(30, ["queued"; 30]);
        p.forecast = Some(90 * SEC);
        assert_eq!(p.eta(Duration::ZERO), Some(90 * SEC));
        for _ in 0..29 {
            p.record("succeeded");
        }
        // Its forecast wins over the rate seen here (which would say 1 s).
        p.forecast = Some(5 * SEC);
        assert_eq!(p.message(29 * SEC), "29/30 done: 29 succeeded, 0 failed, ETA 5s");
        p.forecast = None;
        assert_eq!(p.eta(29 * SEC), Some(SEC));
    }

    #[test]
    fn eta_is_what_remains_at_the_rate_jobs_finished() {
        let mut p = Progress::new(30, ["queued"; 30]);
        for _ in 0..29 {
            p.record("succeeded");
        }
        // 29 in 29 s: the last one in about a second, not minutes.
        assert_eq!(p.eta(29 * SEC), Some(SEC));
        assert_eq!(p.message(29 * SEC), "29/30 done: 29 succeeded, 0 failed, ETA 1s");
        let mut p = Progress::new(100, ["queued"; 100]);
        for _ in 0..10 {
            p.record("failed");
        }
        assert_eq!(p.eta(20 * SEC), Some(180 * SEC));
        p.record("succeeded");
        p.record("cancelled");
        assert_eq!(p.failed, 11);
        p.total = 12;
        assert_eq!(p.message(SEC), "12/12 done: 1 succeeded, 11 failed");
    }

    #[test]
    fn the_count_shown_is_the_bar_s_position() {
        let mut p = Progress::new(
            6,
            ["rejected", "rejected", "queued", "queued", "queued", "queued"],
        );
        assert_eq!(p.finished(), 2);
        for s in ["succeeded", "succeeded", "succeeded", "failed"] {
            p.record(s);
        }
        assert_eq!(p.finished(), 6);
        assert!(
            p.message(SEC)
                .starts_with("6/6 done: 3 succeeded, 1 failed, 2 rejected"),
            "{}",
            p.message(SEC)
        );
    }

    #[test]
    fn durations_read_short() {
        assert_eq!(short_duration(Duration::from_millis(400)), "0s");
        assert_eq!(short_duration(45 * SEC), "45s");
        assert_eq!(short_duration(125 * SEC), "2m05s");
        assert_eq!(short_duration(3 * 3600 * SEC + 7 * 60 * SEC), "3h07m");
    }
}
