//! The bodies of the fuzz targets (`fuzz/fuzz_targets/`), here so that the fuzzers and
//! the ordinary test suite run the same code: `cargo fuzz` explores with coverage
//! guidance; `cargo test` replays the seeds and a few thousand random inputs
//! (`tests` below). Each takes any bytes and panics only when an invariant breaks.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::batches::{Line, LineSplitter, MAX_CUSTOM_ID, parse_line};
use crate::config::Config;
use crate::ratelimit;
use crate::vocab::Dialect;

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
        if let Ok(envelope) = parse_line(line, &mut seen) {
            assert!(!envelope.custom_id.is_empty() && envelope.custom_id.len() <= MAX_CUSTOM_ID);
            assert!(seen.contains(&envelope.custom_id));
            assert!(
                parse_line(line, &mut seen).is_err_and(|r| r.code == "duplicate_custom_id"),
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
        assert!(!config.providers.is_empty() && !config.tenants.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The seed corpora the fuzzers start from (`fuzz/corpus/<target>/`).
    fn corpus(target: &str) -> Vec<Vec<u8>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target);
        let mut inputs: Vec<Vec<u8>> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| std::fs::read(entry.unwrap().path()).unwrap())
            .collect();
        assert!(!inputs.is_empty(), "no seeds in {}", dir.display());
        inputs.sort();
        inputs
    }

    #[test]
    fn fuzz_bodies_pass_over_their_seed_corpora() {
        for input in corpus("jsonl_lines") {
            jsonl_lines(&input);
        }
        for input in corpus("ratelimit_headers") {
            ratelimit_headers(&input);
        }
        for input in corpus("config_parse") {
            config_parse(&input);
        }
    }

    /// Random mutations of the seeds: a byte flipped, inserted or removed, or a run cut.
    fn mutated(target: &'static str) -> impl Strategy<Value = Vec<u8>> {
        let seeds = corpus(target);
        (
            0..seeds.len(),
            proptest::collection::vec((any::<u16>(), any::<u8>(), 0u8..4), 0..8),
        )
            .prop_map(move |(i, edits)| {
                let mut input = seeds[i].clone();
                for (at, byte, op) in edits {
                    let at = if input.is_empty() {
                        0
                    } else {
                        at as usize % input.len()
                    };
                    match op {
                        0 if !input.is_empty() => input[at] = byte,
                        1 => input.insert(at, byte),
                        2 if !input.is_empty() => {
                            input.remove(at);
                        }
                        _ => input.truncate(at),
                    }
                }
                input
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn fuzz_bodies_jsonl_lines_random(input in prop_oneof![proptest::collection::vec(any::<u8>(), 0..512), mutated("jsonl_lines")]) {
            jsonl_lines(&input);
        }

        #[test]
        fn fuzz_bodies_ratelimit_headers_random(input in prop_oneof![proptest::collection::vec(any::<u8>(), 0..512), mutated("ratelimit_headers")]) {
            ratelimit_headers(&input);
        }

        #[test]
        fn fuzz_bodies_config_parse_random(input in prop_oneof![".{0,256}".prop_map(String::into_bytes), mutated("config_parse")]) {
            config_parse(&input);
        }
    }
}
