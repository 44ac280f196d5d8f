//! Migrations are safe to apply to a database that is in use: each one runs against a
//! database holding rows of every migration before it (`migration_fixtures/<migration>.sql`,
//! one per migration, inserted right after it), and the current code reads those rows back.
//! A migration may not add a required column without a default, nor make an existing one
//! required, since either fails on a table that has rows. Migrations are forward-only.

use std::borrow::Cow;
use std::path::Path;

use sqlx::migrate::Migrator;
use tollgate::batches::ResultsCursor;
use tollgate::model::JobId;

use crate::harness::empty_db;

fn fixtures_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/e2e/migration_fixtures")
}

#[tokio::test]
async fn every_migration_applies_to_a_database_holding_rows_of_the_ones_before() {
    let db = empty_db().await;
    let all: Vec<_> = tollgate::MIGRATOR.iter().cloned().collect();
    assert!(!all.is_empty());
    for (i, migration) in all.iter().enumerate() {
        let upto = Migrator {
            migrations: Cow::Owned(all[..=i].to_vec()),
            ..Migrator::DEFAULT
        };
        upto.run(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("migration {} on a database with rows: {e}", migration.version));
        let name = format!(
            "{:04}_{}.sql",
            migration.version,
            migration.description.replace(' ', "_")
        );
        let fixture = std::fs::read_to_string(fixtures_dir().join(&name))
            .unwrap_or_else(|e| panic!("every migration has its rows in migration_fixtures/{name}: {e}"));
        sqlx::raw_sql(&fixture)
            .execute(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("rows of {name}: {e}"));
    }

    // What the fixtures wrote reads back through the store, as the broker reads it.
    let finished: JobId = "0190a000-0000-7000-8000-000000000001".parse().unwrap();
    let job = tollgate::store::get_job(&db.pool, Some("acme"), finished)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(job.state, tollgate::model::JobState::Succeeded);
    assert_eq!(job.dispatch_via.as_deref(), Some("flex"));
    // The flex tier's recent jobs read back by provider model: one served, one refused.
    let flex =
        tollgate::store::flex_observations(&db.pool, chrono::Utc::now() - chrono::Duration::hours(1), 1)
            .await
            .unwrap();
    let seen = flex[&("oai".to_owned(), "gpt-4o-mini".to_owned())];
    assert_eq!((seen.served, seen.refused), (1, 1), "{seen:?}");
    assert!(seen.p90_latency.is_some());
    // A job forecast at submission reads back with its eta, and in the forecasts' record.
    let forecast: JobId = "0190a000-0000-7000-8000-000000000017".parse().unwrap();
    let job = tollgate::store::get_job(&db.pool, Some("acme"), forecast)
        .await
        .unwrap()
        .unwrap();
    assert!(job.eta_p50.is_some() && job.eta_p90.is_some(), "{job:?}");
    let record = tollgate::store::forecast_record(
        &db.pool,
        Some("acme"),
        chrono::Utc::now() - chrono::Duration::hours(1),
    )
    .await
    .unwrap();
    assert_eq!((record.jobs, record.late), (1, 0), "{record:?}");
    // The leading gate's fairness lags read back by class and tenant.
    let lags = tollgate::store::fairness_lags(&db.pool).await.unwrap();
    assert_eq!(
        lags.get(&(tollgate::model::JobClass::Standard, "acme".to_owned())),
        Some(&2730.5)
    );
    // The accounts provider keys were seen serving under read back by provider and key.
    let accounts = tollgate::store::key_accounts(&db.pool).await.unwrap();
    assert!(
        accounts
            .iter()
            .any(|a| (a.provider.as_str(), a.key.as_str(), a.account.as_str()) == ("oai", "main", "org-acme")),
        "{accounts:?}"
    );
    // A queued job past its guard reads back beside its queue's head, wherever it stands;
    // an interactive queue (no guard) reads its head once.
    let now = chrono::Utc::now();
    let read = |class| {
        let pool = db.pool.clone();
        async move {
            let (queue, guard) = (
                [(class, "acme".to_owned())],
                [now - chrono::Duration::seconds(60)],
            );
            tollgate::store::candidates(&pool, &queue, &guard, 1, now)
                .await
                .unwrap()
        }
    };
    let standard = read(tollgate::model::JobClass::Standard).await;
    let starving: JobId = "0190a000-0000-7000-8000-000000000020".parse().unwrap();
    assert!(standard.iter().any(|c| c.id == starving), "{standard:?}");
    let interactive = read(tollgate::model::JobClass::Interactive).await;
    let asking: JobId = "0190a000-0000-7000-8000-000000000021".parse().unwrap();
    assert_eq!(
        interactive.iter().map(|c| c.id).collect::<Vec<_>>(),
        [asking],
        "an interactive queue's head, read once"
    );
    let queued: JobId = "0190a000-0000-7000-8000-000000000002".parse().unwrap();
    let job = tollgate::store::get_job(&db.pool, Some("acme"), queued)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(job.provider_batch_id.as_deref(), Some("pb_fixture"));
    assert_eq!(
        job.endpoint,
        tollgate::vocab::Endpoint::ChatCompletions,
        "a job from before 0008 is chat"
    );
    let charged: JobId = "0190a000-0000-7000-8000-000000000011".parse().unwrap();
    let job = tollgate::store::get_job(&db.pool, Some("acme"), charged)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(job.spend_micro_usd, Some(42.0));
    let embeddings: JobId = "0190a000-0000-7000-8000-000000000008".parse().unwrap();
    let job = tollgate::store::get_job(&db.pool, Some("acme"), embeddings)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(job.endpoint, tollgate::vocab::Endpoint::Embeddings);
    let open = tollgate::store::batch_has_open_jobs(&db.pool, "batch_0190a000000070008000000000000004").await;
    assert!(open.unwrap(), "the batch's line is the queued job");
    let batch = tollgate::store::get_batch(&db.pool, Some("acme"), "batch_0190a000000070008000000000000004")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((batch.total, batch.rejected), (2, 1));
    let message_batch = tollgate::store::get_batch(
        &db.pool,
        Some("acme"),
        "msgbatch_0190a000000070008000000000000009",
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(message_batch.input_file_id, None, "its requests came inline");
    assert_eq!(
        (message_batch.cancelled, message_batch.expired),
        (Some(1), Some(1))
    );
    let tenants = tollgate::store::list_tenants(&db.pool).await.unwrap();
    let tenants: Vec<(&str, Option<&str>)> = tenants
        .iter()
        .map(|t| (t.spec.name.as_str(), t.spec.parent.as_deref()))
        .collect();
    assert_eq!(tenants, [("acme", Some("unit")), ("unit", None)]);
    let keys = tollgate::store::list_keys(&db.pool, "acme").await.unwrap();
    assert_eq!(
        keys.iter()
            .map(|k| (k.name.as_str(), k.budgets.len()))
            .collect::<Vec<_>>(),
        [("config", 0)],
        "a key from 0012 has no budgets of its own"
    );
    assert_eq!(job.api_key, None, "a job from before 0012 names no key");
    let provider_keys = tollgate::store::list_provider_keys(&db.pool).await.unwrap();
    let provider_keys: Vec<(&str, bool, bool, Option<&str>)> = provider_keys
        .iter()
        .map(|k| {
            (
                k.name.as_str(),
                k.sealed_value.is_some(),
                k.disabled_at.is_some(),
                k.account.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        provider_keys,
        [
            ("declared", true, false, Some("proj-a")),
            ("k1", false, true, None),
            ("runtime", true, false, None)
        ],
        "keys from before 0025 are declared in no account"
    );
    let pauses = tollgate::store::list_pauses(&db.pool, chrono::Utc::now())
        .await
        .unwrap();
    assert_eq!(
        pauses
            .iter()
            .map(|p| (p.scope.as_str(), p.reason.as_str()))
            .collect::<Vec<_>>(),
        [("tenant:acme", "operator")]
    );
    let samples = tollgate::store::status_samples(&db.pool, chrono::Utc::now() - chrono::Duration::hours(1))
        .await
        .unwrap();
    assert_eq!(samples.len(), 1);
    assert_eq!(samples[0].traffic["acme"]["succeeded"], 4);
    let buckets = tollgate::store::all_buckets(&db.pool).await.unwrap();
    assert_eq!(buckets.len(), 1);
    let learned = tollgate::store::learned_limits(&db.pool).await.unwrap();
    assert_eq!(learned.len(), 1);
    let pack = tollgate::store::get_provider_batch(&db.pool, "pb_fixture")
        .await
        .unwrap();
    assert_eq!(
        pack.unwrap().endpoint,
        tollgate::vocab::Endpoint::ChatCompletions,
        "a pack from before 0010 carried chat"
    );
    let pack = tollgate::store::get_provider_batch(&db.pool, "pb_fixture_embeddings")
        .await
        .unwrap();
    assert_eq!(pack.unwrap().endpoint, tollgate::vocab::Endpoint::Embeddings);
    let limits = tollgate::store::ClaimLimits {
        slots: 10,
        per_endpoint: 4,
        per_tenant: 4,
    };
    let mut due = tollgate::store::claim_deliveries(
        &db.pool,
        chrono::Utc::now() + chrono::Duration::hours(2),
        limits,
        std::time::Duration::from_secs(30),
    )
    .await
    .unwrap();
    due.sort_by(|a, b| a.id.cmp(&b.id));
    let due: Vec<(&str, &str)> = due.iter().map(|d| (d.id.as_str(), d.url.as_str())).collect();
    assert_eq!(
        due,
        [
            ("msg_fixture", "https://hooks.example/acme"),
            ("msg_fixture_in_flight", "https://hooks.example/globex"),
            ("msg_fixture_retired", "https://hooks.example/globex"),
        ],
        "a retired endpoint's deliveries are still sent; a lease long over is no lease"
    );
    let disabled = tollgate::store::disabled_endpoints(&db.pool, true).await.unwrap();
    let disabled: Vec<_> = disabled
        .iter()
        .map(|e| (e.url.as_str(), e.disabled_reason.as_deref()))
        .collect();
    assert_eq!(
        disabled,
        [("https://hooks.example/acme-old", Some("failing since then"))]
    );
    // A synchronous call whose caller's process held it and stopped is not sent again
    // (0022), nor one still queued whose caller's process stopped beating (0023).
    let rescued = tollgate::store::rescue_expired_leases(&db.pool, chrono::Utc::now())
        .await
        .unwrap();
    assert_eq!(
        (rescued.failed, rescued.requeued, rescued.callers_gone),
        (1, 0, 1),
        "{rescued:?}"
    );
    for id in [
        "0190a000-0000-7000-8000-000000000022",
        "0190a000-0000-7000-8000-000000000023",
    ] {
        let job = tollgate::store::get_job(&db.pool, Some("acme"), id.parse().unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (job.state, job.error_code.as_deref()),
            (tollgate::model::JobState::Failed, Some("client_disconnected")),
            "{id}"
        );
    }
    // A batch's results: the line numbered before 0024, then the one that ended after it,
    // each once from the cursor before it.
    let batch = "batch_0190a000000070008000000000000013";
    let read = |after| tollgate::store::batch_results_after(&db.pool, batch, after, 1, true);
    let first = read(ResultsCursor::START).await.unwrap();
    assert_eq!(
        first.iter().map(|l| l.custom_id.as_str()).collect::<Vec<_>>(),
        ["first"]
    );
    let cursor = |line: &tollgate::store::BatchJobResult| ResultsCursor {
        xid: line.result_xid.unwrap(),
        id: line.id,
    };
    let second = read(cursor(&first[0])).await.unwrap();
    assert_eq!(
        second.iter().map(|l| l.custom_id.as_str()).collect::<Vec<_>>(),
        ["second"]
    );
    assert!(read(cursor(&second[0])).await.unwrap().is_empty());
}

#[test]
fn every_fixture_belongs_to_a_migration() {
    let names: Vec<String> = tollgate::MIGRATOR
        .iter()
        .map(|m| format!("{:04}_{}.sql", m.version, m.description.replace(' ', "_")))
        .collect();
    for entry in std::fs::read_dir(fixtures_dir()).unwrap() {
        let file = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            names.contains(&file),
            "migration_fixtures/{file} names no migration"
        );
    }
}

#[test]
fn migrations_are_forward_only_and_add_no_required_column_without_a_default() {
    for migration in tollgate::MIGRATOR.iter() {
        assert!(
            !migration.migration_type.is_down_migration() && !migration.migration_type.is_reversible(),
            "migration {} has a down migration: migrations are forward-only",
            migration.version
        );
        let unsafe_changes = required_column_changes(&migration.sql);
        assert!(
            unsafe_changes.is_empty(),
            "migration {} fails on a table with rows: {unsafe_changes:?}",
            migration.version
        );
    }
}

#[test]
fn the_required_column_check_finds_what_it_must() {
    let sql = "ALTER TABLE jobs ADD COLUMN a text NOT NULL, ADD COLUMN b int NOT NULL DEFAULT 0,
               ADD COLUMN c jsonb;\nALTER TABLE jobs ALTER COLUMN d SET NOT NULL;
               -- ADD COLUMN e text NOT NULL (a comment)
               CREATE TABLE t (f text NOT NULL);";
    assert_eq!(
        required_column_changes(sql),
        vec![
            "ADD COLUMN a text NOT NULL".to_string(),
            "ALTER COLUMN d SET NOT NULL".to_string()
        ]
    );
}

/// The clauses of `sql` that fail on a table holding rows: `ADD COLUMN … NOT NULL` without a
/// `DEFAULT`, and `ALTER COLUMN … SET NOT NULL`.
fn required_column_changes(sql: &str) -> Vec<String> {
    let code: String = sql
        .lines()
        .map(|line| line.split("--").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join(" ");
    let upper = code.to_uppercase();
    let mut found = Vec::new();
    for keyword in ["ADD COLUMN", "ALTER COLUMN"] {
        let mut from = 0;
        while let Some(at) = upper[from..].find(keyword).map(|i| i + from) {
            let clause_end = clause_end(&upper, at);
            let clause = upper[at..clause_end]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            let required = if keyword == "ADD COLUMN" {
                clause.contains("NOT NULL") && !clause.contains("DEFAULT")
            } else {
                clause.contains("SET NOT NULL")
            };
            if required {
                found.push(
                    code[at..clause_end]
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .join(" "),
                );
            }
            from = clause_end;
        }
    }
    found
}

/// Where the clause starting at `start` ends: the next `,` or `;` outside parentheses.
fn clause_end(sql: &str, start: usize) -> usize {
    let mut depth = 0i32;
    for (i, c) in sql[start..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' | ';' if depth <= 0 => return start + i,
            _ => {}
        }
    }
    sql.len()
}
