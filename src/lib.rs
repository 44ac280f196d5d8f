//! tollgate core: what every role shares.
//!
//! - [`vocab`]: the vocabulary — states, classes, dimensions, limit names, lanes, error and
//!   reason codes — as enums; strings only at the wire and in SQL. Imports nothing else.
//! - [`clock`]: the time leases, deadlines, holds and retries are reckoned in: the
//!   database's, sampled and advanced by the monotonic clock.
//! - [`config`]: the TOML configuration, its defaults and validation.
//! - [`model`]: jobs, their ids, states and classes.
//! - [`attempt`]: how one attempt of a job ends — the outcome a dispatcher builds from a
//!   provider call and the store writes.
//! - [`store`]: all SQL — insert, claim, complete, rescue — as small functions.
//! - [`db`]: connecting (URL or [`embedded`] PostgreSQL) and migrating ([`MIGRATOR`]).
//! - [`notify`]: one LISTEN connection per process, fanned out to waiters.
//! - [`tenant_spec`]: a tenant's limits, budgets and settings, and the rules they follow.
//! - [`tenants`]: tenants, their limits, budgets and keys; the directory API keys are
//!   looked up in.
//! - [`control`]: the control plane: tenants and keys changed at runtime, seeded from the
//!   config file, and each process's directory kept current within a second.
//! - [`sanitize`]: outside text made safe to store and show (U+0000, secrets in provider
//!   messages).
//! - [`keyring`]: provider keys as the control plane has them: the file's less those
//!   disabled at runtime, and those added at runtime.
//! - [`holds`]: operator pauses of a tenant's queue, a route or a provider model.
//! - [`routing`]: requested model (route alias or `provider/model`) → provider targets.
//! - [`estimate`]: token demand of a request, made at submit time.
//! - [`buckets`]: limits as buckets, a job's path through them, their arithmetic.
//! - [`scheduler`]: admission policy, pure — class precedence, weighted fair queuing over
//!   tenants, bucket fit, failure verdicts and wait notes (its [`scheduler::plan`] makes a
//!   queued job into what it decides on).
//! - [`provider_batches`]: provider batch APIs as a scheduling choice for `batch` jobs.
//! - [`forecast`]: when work accepted now is expected to finish (its `eta`), from the
//!   queue ahead of it and the buckets on its path.
//! - [`reread`]: a value read from the database at most once a period.
//! - [`retry`]: failure classification and the retry decision (retry, fall back, rotate the
//!   key, pause, fail).
//! - [`batches`]: files and batches (OpenAI's Files and Batch APIs): ids, statuses, rows,
//!   and the JSONL input's line splitter and envelope check.
//! - [`webhook_signing`]: Standard Webhooks secrets and signatures.
//! - [`webhook_secrets`]: webhook secrets at rest, sealed under the server's webhook key.
//! - [`ratelimit`]: what providers say about their limits (headers, 429 bodies), parsed.
//! - [`learning`]: learned limits — readings and 429s turned into bucket capacities.
//! - [`metrics`]: metric names, and the one-line helpers the gate and dispatchers call.
//! - [`job_trace`]: one OpenTelemetry trace per job, its spans made from the job's row.
//! - `fuzz_bodies`: the fuzz targets' bodies (`fuzz/`), also replayed by `cargo test`.
//!
//! Data flow: the API (`tollgate-api`) authenticates through `tenants`, resolves through
//! `routing`, estimates, and inserts through `store` (state `queued`); the gate role
//! (`tollgate-workers`) reads queued jobs through `store`, lets the `scheduler` admit those
//! whose `buckets` can hold them, and writes them `admitted` (reservations held);
//! dispatchers (`tollgate-workers`) claim admitted jobs through `store`, call providers,
//! classify failures and decide what follows through `retry`, and write each attempt's
//! [`attempt::Outcome`] back through `store`, settling the reservations; NOTIFYs reach
//! waiters through `notify`.

pub mod attempt;
pub mod batches;
pub mod buckets;
pub mod clock;
pub mod config;
pub mod control;
pub mod db;
pub mod embedded;
pub mod estimate;
pub mod forecast;
#[doc(hidden)]
pub mod fuzz_bodies;
pub mod gather;
pub mod holds;
pub mod job_trace;
pub mod keyring;
pub mod learning;
pub mod metrics;
pub mod model;
pub mod notify;
pub mod provider_batches;
pub mod ratelimit;
pub mod reread;
pub mod retry;
pub mod routing;
pub mod sanitize;
pub mod scheduler;
pub mod store;
pub mod tenant_spec;
pub mod tenants;
pub mod vocab;
pub mod webhook_secrets;
pub mod webhook_signing;

/// The schema's migrations; every crate's database code and tests use this one.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// The core's top-level modules and the ones each imports or links to in its docs
    /// (`crate::x`), read from the sources; a folder module (`store/`) counts as one.
    fn module_imports() -> BTreeMap<String, BTreeSet<String>> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut read = |module: &str, path: &Path| {
            let text = std::fs::read_to_string(path).unwrap();
            let imports = graph.entry(module.to_owned()).or_default();
            // Code and doc links (`///`, `//!` name what a module leans on); plain comments
            // are prose.
            let counted = |l: &&str| {
                let l = l.trim_start();
                !l.starts_with("//") || l.starts_with("///") || l.starts_with("//!")
            };
            for line in text.lines().filter(counted) {
                for (at, _) in line.match_indices("crate::") {
                    let name: String = line[at + 7..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() && name != module && name != "MIGRATOR" {
                        imports.insert(name);
                    }
                }
            }
        };
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                for inner in std::fs::read_dir(&path).unwrap() {
                    read(&stem, &inner.unwrap().path());
                }
            } else if stem != "lib" && path.extension().is_some_and(|e| e == "rs") {
                read(&stem, &path);
            }
        }
        graph
    }

    /// A cycle in `graph`, if it has one.
    fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
        fn visit(
            node: &str,
            graph: &BTreeMap<String, BTreeSet<String>>,
            path: &mut Vec<String>,
            done: &mut BTreeSet<String>,
        ) -> Option<Vec<String>> {
            if let Some(at) = path.iter().position(|n| n == node) {
                let mut found = path[at..].to_vec();
                found.push(node.to_owned());
                return Some(found);
            }
            if done.contains(node) {
                return None;
            }
            path.push(node.to_owned());
            for next in graph.get(node).into_iter().flatten() {
                if let Some(found) = visit(next, graph, path, done) {
                    return Some(found);
                }
            }
            path.pop();
            done.insert(node.to_owned());
            None
        }
        let mut done = BTreeSet::new();
        graph
            .keys()
            .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
    }

    #[test]
    fn the_core_modules_import_each_other_without_a_cycle() {
        let graph = module_imports();
        assert!(
            graph.contains_key("store") && graph.contains_key("scheduler"),
            "{graph:?}"
        );
        assert_eq!(
            cycle(&graph),
            None,
            "the core's modules import each other in a cycle"
        );
    }

    #[test]
    fn the_cycle_check_finds_a_cycle() {
        let graph: BTreeMap<String, BTreeSet<String>> = [
            ("a", vec!["b"]),
            ("b", vec!["c"]),
            ("c", vec!["a"]),
            ("d", vec![]),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
        .collect();
        assert_eq!(cycle(&graph).map(|c| c.len()), Some(4), "a -> b -> c -> a");
    }

    #[test]
    fn the_vocabulary_imports_nothing_of_the_core() {
        assert_eq!(module_imports().get("vocab"), Some(&BTreeSet::new()));
    }
}
