//! The bodies of the core crate's fuzz targets (`fuzz/fuzz_targets/`), here so that the
//! fuzzers and the ordinary test suite run the same code: `cargo fuzz` explores with
//! coverage guidance; `cargo test` replays the seeds and a few thousand random inputs
//! through [`replay`], which the API's and the workers' fuzz bodies
//! (`tollgate_api::fuzz_bodies`, `tollgate_workers::fuzz_bodies`) use too. Each body takes
//! any bytes and panics only when an invariant breaks.

use std::collections::HashSet;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use http::{HeaderMap, HeaderName, HeaderValue};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::batches::{Line, LineSplitter, MAX_CUSTOM_ID, parse_line};
use crate::config::Config;
use crate::ratelimit;
use crate::vocab::{Dialect, Endpoint};

/// A batch input file, split and checked line by line. The first byte picks the line
/// limit and the size of the chunks the file arrives in. Invariants: line numbers
/// increase; no line holds a newline or exceeds the limit; the lines do not depend on
/// how the file was chunked; an accepted envelope has a valid, first-seen `custom_id`.
pub fn jsonl_lines(data: &[u8]) {
    let Some((&knob, file)) = data.split_first() else {
        return;
    };
    let max = 1 + (knob as usize % 32) * 8;
    let chunk = 1 + (knob as usize / 32) * 7;
    let split = |chunk: usize| {
        let mut splitter = LineSplitter::new(max);
        let mut out: Vec<(i32, Option<Vec<u8>>)> = Vec::new();
        let parts: Vec<&[u8]> = if file.is_empty() {
            vec![file]
        } else {
            file.chunks(chunk).collect()
        };
        for (i, part) in parts.iter().enumerate() {
            for (n, line) in splitter.feed(part, false) {
                out.push((n, text(line)));
            }
            if i + 1 == parts.len() {
                for (n, line) in splitter.feed(&[], true) {
                    out.push((n, text(line)));
                }
            }
        }
        out
    };
    let chunked = split(chunk);
    assert_eq!(chunked, split(file.len().max(1)), "lines depend on chunking");
    let newlines = file.iter().filter(|&&b| b == b'\n').count() as i32;
    let mut previous = 0;
    let mut seen = HashSet::new();
    for (number, line) in &chunked {
        assert!(
            *number > previous && *number <= newlines + 1,
            "line number {number}"
        );
        previous = *number;
        let Some(line) = line else { continue };
        assert!(line.len() <= max && !line.contains(&b'\n'));
        assert!(
            line.iter().any(|b| !b.is_ascii_whitespace()),
            "a blank line was handed out"
        );
        if let Ok(envelope) = parse_line(line, Endpoint::ChatCompletions, &mut seen) {
            assert!(!envelope.custom_id.is_empty() && envelope.custom_id.len() <= MAX_CUSTOM_ID);
            assert!(seen.contains(&envelope.custom_id));
            assert!(
                parse_line(line, Endpoint::ChatCompletions, &mut seen)
                    .is_err_and(|r| r.code == "duplicate_custom_id"),
                "the same line twice is a duplicate"
            );
        }
    }
}

fn text(line: Line<'_>) -> Option<Vec<u8>> {
    match line {
        Line::Text(t) => Some(t.to_vec()),
        Line::TooLarge => None,
    }
}

const DIALECTS: [Dialect; 8] = [
    Dialect::Openai,
    Dialect::Groq,
    Dialect::Anthropic,
    Dialect::Mistral,
    Dialect::Together,
    Dialect::Azure,
    Dialect::Gemini,
    Dialect::None,
];

/// Header names the dialects read, so that random values meet the parsers.
const NAMES: [&str; 24] = [
    "retry-after",
    "retry-after-ms",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-limit",
    "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-input-tokens-limit",
    "anthropic-ratelimit-input-tokens-remaining",
    "anthropic-ratelimit-input-tokens-reset",
    "anthropic-ratelimit-output-tokens-limit",
    "anthropic-ratelimit-tokens-limit",
    "x-ratelimit-limit-req-minute",
    "x-ratelimit-remaining-req-minute",
    "x-ratelimit-limit-tokens-minute",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "x-tokenlimit-limit",
    "x-tokenlimit-remaining",
];

/// A provider response's rate-limit signals: the first byte picks the dialect; then
/// `\n`-separated lines, each `<name index byte><value>`, become headers, and everything
/// after a `\0` is the body. Invariants: readings are finite and non-negative, no
/// duration parser panics, and durations stay below a century.
pub fn ratelimit_headers(data: &[u8]) {
    let Some((&knob, rest)) = data.split_first() else {
        return;
    };
    let dialect = DIALECTS[knob as usize % DIALECTS.len()];
    let (head, body) = match rest.iter().position(|&b| b == 0) {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (rest, &[][..]),
    };
    let mut headers = HeaderMap::new();
    for line in head.split(|&b| b == b'\n') {
        let Some((&which, value)) = line.split_first() else {
            continue;
        };
        let name = HeaderName::from_static(NAMES[which as usize % NAMES.len()]);
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.append(name, value);
        }
    }
    let now: DateTime<Utc> = Utc
        .with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
        .single()
        .unwrap_or_default();
    let century = Duration::from_secs(100 * 365 * 86_400);
    let signals = ratelimit::read(dialect, &headers, body, now);
    for r in &signals.readings {
        for v in [r.limit, r.remaining].into_iter().flatten() {
            assert!(v.is_finite() && v >= 0.0, "{dialect:?} reading {r:?}");
        }
        assert!(r.reset.is_none_or(|d| d <= century), "{r:?}");
    }
    assert!(signals.retry_after.is_none_or(|d| d <= century), "{signals:?}");
    assert!(ratelimit::retry_after(&headers, now).is_none_or(|d| d <= century));
    let text = String::from_utf8_lossy(body);
    assert!(ratelimit::try_again_in(&text).is_none_or(|d| d <= century));
    assert!(ratelimit::parse_go_duration(&text).is_none_or(|d| d <= century));
}

/// A config file. Invariant: whatever parses validates again, and no input panics.
pub fn config_parse(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = Config::parse(text, "fuzz") {
        assert!(config.validate().is_ok());
        let admin = config.server.admin_key.is_some() || config.server.admin_key_env.is_some();
        assert!(!config.providers.is_empty() && (!config.tenants.is_empty() || admin));
    }
}

/// The seed corpus of `target`: the files of `fuzz/corpus/<target>/`, sorted by content.
pub fn seeds(target: &str) -> std::io::Result<Vec<Vec<u8>>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        inputs.push(std::fs::read(entry?.path())?);
    }
    inputs.sort();
    Ok(inputs)
}

/// One seed of `target`'s corpus, by its file name.
pub fn seed(target: &str, name: &str) -> std::io::Result<Vec<u8>> {
    std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target)
            .join(name),
    )
}

/// Runs `body` over the seed corpus of `target` (which must not be empty), then over
/// `random` more inputs: random bytes, and seeds with a few bytes changed, inserted or
/// removed, or cut short. The inputs are the same on every run (the generator is seeded
/// by the target's name), and an input that fails is shown in the panic, escaped, so it
/// can be kept as a seed. Test support for every crate's fuzz bodies.
pub fn replay(target: &str, random: usize, body: impl Fn(&[u8])) {
    let seeds = match seeds(target) {
        Ok(seeds) if !seeds.is_empty() => seeds,
        Ok(_) => panic!("no seeds in fuzz/corpus/{target}"),
        Err(e) => panic!("fuzz/corpus/{target}: {e}"),
    };
    let run = |what: &str, input: &[u8]| {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| body(input))) {
            let shown: String = input.escape_ascii().to_string().chars().take(4096).collect();
            eprintln!("{target}: this {what} input failed: b\"{shown}\"");
            resume_unwind(panic);
        }
    };
    for seed in &seeds {
        run("seed", seed);
    }
    let mut rng = StdRng::seed_from_u64(
        target
            .bytes()
            .fold(0, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))),
    );
    for _ in 0..random {
        let input = if rng.random_bool(0.25) {
            let len = rng.random_range(0..512);
            (0..len).map(|_| rng.random()).collect()
        } else {
            let mut input = seeds[rng.random_range(0..seeds.len())].clone();
            for _ in 0..rng.random_range(0..8) {
                let at = rng.random_range(0..=input.len());
                match rng.random_range(0..4) {
                    0 if at < input.len() => input[at] = rng.random(),
                    1 => input.insert(at, rng.random()),
                    2 if at < input.len() => {
                        input.remove(at);
                    }
                    _ => input.truncate(at),
                }
            }
            input
        };
        run("random", &input);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuzz_bodies_jsonl_lines() {
        replay("jsonl_lines", 2000, jsonl_lines);
    }

    #[test]
    fn fuzz_bodies_ratelimit_headers() {
        replay("ratelimit_headers", 2000, ratelimit_headers);
    }

    #[test]
    fn fuzz_bodies_config_parse() {
        replay("config_parse", 2000, config_parse);
    }
}
