//! Learned limits: what providers said about their limits ([`crate::ratelimit`]) and what
//! their 429s taught, turned into bucket capacities and levels.
//!
//! - A reported limit sets the capacity of the bucket `<scope>:<name>`; the gate creates
//!   the bucket when the config has none. Configured limits stay an upper bound unless the
//!   provider is the authority ([`Authority`]).
//! - A reported `remaining` corrects the level down (never up): the provider counted
//!   something tollgate did not (other clients of the account, a different count).
//! - Where nothing is reported, 429s teach (AIMD), a request limit and a token limit
//!   (only the one the 429's body names, where it names one — OpenAI's `error.type`; else
//!   both): a 429 cuts the capacity to [`DECREASE`] of itself and
//!   remembers the old one as the ceiling; while the bucket is saturated and no 429 comes,
//!   the capacity climbs back quickly towards 90 % of the ceiling, then slowly, more
//!   slowly after each cut — so 429s taper off. A 429 cuts only the limits that held the
//!   traffic back (their bucket nearly empty, [`spared`]): one with room to spare did not
//!   let too much through, and cutting it would make it bind below the provider's limit.
//!
//! - A learned capacity is trusted to refuse a job larger than itself only while it is
//!   fresh ([`TRUSTED_FOR`] since the last reading or cut). After that it may be stale or
//!   a bogus reading that nothing sent can correct (every job it refuses brings no new
//!   headers): such a job is asked for the whole bucket instead ([`demand`]), so it goes
//!   alone once the bucket is full, and its answer renews or corrects the reading — a
//!   re-probe. A configured capacity is never overruled this way.
//!
//! - Until then, while responses come without saying a limit, calls are paced
//!   ([`pace_up`]): a request bucket `<scope>:pace` that starts at `gate.pace_start_rps`
//!   and doubles each [`PACE_DOUBLES_EVERY`] while it holds jobs back. A provider that says
//!   nothing meets the first 429 at the rate sent then, and every call in flight at that
//!   moment meets one too: doubling once a second keeps that rate near 0.7 × the provider's
//!   burst per second (instead of as fast as the dispatchers go), and costs little time —
//!   the provider's buckets refill while the pace grows. The first limit learned retires it.
//!
//! Everything here is arithmetic on a [`Learned`] row and its [`Bucket`]; the gate applies
//! it inside its round, while it holds the bucket locks.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::buckets::{Bucket, BucketSpec};
use crate::keyring::KeyAccount;
use crate::ratelimit::Reading;
use crate::vocab::{Authority, Dimension, LearnedFrom, LimitName, Rule};

/// What a 429 leaves of the capacity.
pub const DECREASE: f64 = 0.7;
/// 429s closer together than this count as one (the same burst).
pub const DECREASE_GAP: Duration = Duration::from_secs(3);
/// How long a bucket must be saturated without a 429 before its capacity grows.
pub const INCREASE_EVERY: Duration = Duration::from_secs(4);
/// How long a learned capacity may refuse jobs larger than itself without being renewed.
pub const TRUSTED_FOR: Duration = Duration::from_secs(300);
/// How often at most a pace doubles ([`pace_up`]).
pub const PACE_DOUBLES_EVERY: Duration = Duration::from_secs(1);
/// Growth per step below 90 % of the ceiling (recovery).
const RECOVER: f64 = 1.25;
/// Growth per step above it, divided by 1 + the number of cuts so far (probing).
const PROBE_STEP: f64 = 0.04;

/// One learned limit (a `learned_limits` row).
#[derive(Debug, Clone, PartialEq)]
pub struct Learned {
    pub scope: String,
    pub name: LimitName,
    pub reported: Option<f64>,
    pub remaining: Option<f64>,
    pub observed_at: DateTime<Utc>,
    pub throttled_at: Option<DateTime<Utc>>,
    pub source: LearnedFrom,
    pub ceiling: Option<f64>,
    pub decreases: i32,
    pub changed_at: Option<DateTime<Utc>>,
    pub applied_at: Option<DateTime<Utc>>,
}

impl Learned {
    /// The bucket this limit governs.
    pub fn bucket_key(&self) -> String {
        format!("{}:{}", self.scope, self.name.as_str())
    }

    /// The newest news in the row.
    pub fn latest(&self) -> DateTime<Utc> {
        self.throttled_at
            .map_or(self.observed_at, |t| t.max(self.observed_at))
    }

    /// Whether the row says something the gate has not applied yet.
    pub fn pending(&self) -> bool {
        self.applied_at.is_none_or(|a| self.latest() > a)
    }

    /// Whether the row knows a capacity (so its bucket should exist).
    pub fn governs(&self) -> bool {
        self.reported.is_some() || self.throttled_at.is_some()
    }

    fn new_reading(&self) -> bool {
        self.applied_at.is_none_or(|a| self.observed_at > a)
    }

    fn new_throttle(&self) -> bool {
        self.throttled_at
            .is_some_and(|t| self.applied_at.is_none_or(|a| t > a))
    }
}

/// Sets a bucket's capacity. A smaller one caps the level (as a provider that lowers a
/// limit caps what is left, not what was used); a larger one fills by refill, faster.
fn set_capacity(bucket: &mut Bucket, capacity: f64) {
    bucket.capacity = capacity;
    bucket.level = bucket.level.min(capacity);
}

/// Applies what `row` says that is new to its `bucket`, at `now`. Returns whether the row
/// changed (it always records what it applied).
pub fn apply(row: &mut Learned, bucket: &mut Bucket, authority: Authority, now: DateTime<Utc>) {
    if row.new_reading() {
        if let Some(reported) = row.reported {
            let capacity = match (authority, bucket.configured_capacity) {
                (Authority::Config, Some(configured)) => configured.min(reported),
                _ => reported,
            };
            if (capacity - bucket.capacity).abs() > 1e-9 {
                set_capacity(bucket, capacity);
            }
            bucket.learned_at = Some(row.observed_at);
        }
        if let Some(remaining) = row.remaining {
            // What the provider had left then, plus what refilled since.
            let since = (now - row.observed_at).num_milliseconds().max(0) as f64 / 1000.0;
            bucket.level = bucket.level.min(remaining + bucket.rate() * since);
        }
    }
    if row.new_throttle() && row.source == LearnedFrom::Throttling {
        decrease(row, bucket, now);
    }
    row.applied_at = Some(row.latest());
}

/// A 429 without limit information: cut the capacity (once per burst of 429s), and take
/// the level to zero — the provider had nothing left.
pub fn decrease(row: &mut Learned, bucket: &mut Bucket, now: DateTime<Utc>) {
    bucket.level = bucket.level.min(0.0);
    let recent = row
        .changed_at
        .is_some_and(|c| (now - c).to_std().unwrap_or_default() < DECREASE_GAP);
    if recent {
        return;
    }
    row.ceiling = Some(bucket.capacity);
    bucket.capacity = (bucket.capacity * DECREASE).max(1.0);
    row.decreases += 1;
    row.changed_at = Some(now);
    bucket.learned_at = Some(now);
}

/// Probing upward: a bucket learned from 429s that stopped a job this round (`saturated`)
/// and has seen no 429 for [`INCREASE_EVERY`] grows. Returns whether it grew.
pub fn increase(row: &mut Learned, bucket: &mut Bucket, saturated: bool, now: DateTime<Utc>) -> bool {
    if !saturated || row.source != LearnedFrom::Throttling {
        return false;
    }
    let quiet_since = row.changed_at.into_iter().chain(row.throttled_at).max();
    if quiet_since.is_some_and(|t| (now - t).to_std().unwrap_or_default() < INCREASE_EVERY) {
        return false;
    }
    let capacity = bucket.capacity;
    let grown = match row.ceiling {
        Some(ceiling) if capacity < 0.9 * ceiling => (capacity * RECOVER).min(0.9 * ceiling),
        _ => capacity * (1.0 + PROBE_STEP / (1.0 + f64::from(row.decreases))),
    }
    .max(capacity + 1.0);
    set_capacity(bucket, grown);
    row.changed_at = Some(now);
    bucket.learned_at = Some(now);
    true
}

/// The pace bucket of a scope ([`pace_up`]).
pub fn pace_key(scope: &str) -> String {
    format!("{scope}:pace")
}

/// Whether `key` is a pace bucket (see [`pace_key`]).
pub fn is_pace(key: &str) -> bool {
    key.ends_with(":pace")
}

/// The pace of `scope`: `per_sec` requests a second, a second's worth at once at most.
pub fn pace_spec(scope: &str, per_sec: f64) -> BucketSpec {
    BucketSpec {
        key: pace_key(scope),
        scope: scope.to_owned(),
        dimension: Dimension::Requests,
        rule: Rule::Rolling,
        capacity: per_sec.max(1.0),
        window_secs: 1,
        ramp_step: None,
    }
}

/// Doubles a pace that held jobs back this round (`saturated`) and has not grown for
/// [`PACE_DOUBLES_EVERY`] (`learned_at` is when it last changed). The level is left as
/// it is: the doubled rate refills it, so no burst follows a doubling. Returns whether it
/// grew.
pub fn pace_up(bucket: &mut Bucket, saturated: bool, now: DateTime<Utc>) -> bool {
    let due = bucket
        .learned_at
        .is_none_or(|at| (now - at).to_std().unwrap_or_default() >= PACE_DOUBLES_EVERY);
    if !saturated || !due {
        return false;
    }
    bucket.capacity *= 2.0;
    bucket.learned_at = Some(now);
    true
}

/// The share of its capacity a bucket may have left when a 429 comes and still count as
/// what held the traffic back.
const NEARLY_EMPTY: f64 = 0.2;

/// The buckets (keys) of 429-learned limits that a new 429 spares: in a scope where some
/// such bucket was nearly empty (it held the traffic back), those that had room to spare.
/// Where none was nearly empty (someone else used the account), none is spared.
pub fn spared(rows: &[Learned], buckets: &HashMap<String, Bucket>) -> HashSet<String> {
    let throttled: Vec<(&Learned, &Bucket)> = rows
        .iter()
        .filter(|r| r.source == LearnedFrom::Throttling && r.new_throttle())
        .filter_map(|r| Some((r, buckets.get(&r.bucket_key())?)))
        .collect();
    let nearly_empty = |b: &Bucket| b.level <= NEARLY_EMPTY * b.capacity;
    let binding: HashSet<&str> = throttled
        .iter()
        .filter(|(_, b)| nearly_empty(b))
        .map(|(r, _)| r.scope.as_str())
        .collect();
    throttled
        .iter()
        .filter(|(r, b)| binding.contains(r.scope.as_str()) && !nearly_empty(b))
        .map(|(r, _)| r.bucket_key())
        .collect()
}

/// What a job that needs `amount` of `bucket` is asked of it at `now`: `amount`, or the
/// whole capacity when that is smaller than `amount`, no configured capacity refuses
/// `amount`, and the capacity is either learned more than [`TRUSTED_FOR`] ago (see the
/// module's re-probe) or only `guessed` from 429s. A 429 says too much was sent in a
/// window, never that one request is too large: the provider took each request before
/// it, so a guessed capacity below a job's size lets the job go alone, never fails it.
pub fn demand(bucket: &Bucket, amount: f64, guessed: bool, now: DateTime<Utc>) -> f64 {
    let stale = bucket
        .learned_at
        .is_some_and(|at| (now - at).to_std().unwrap_or_default() >= TRUSTED_FOR);
    let configured_holds = bucket.configured_capacity.is_none_or(|c| amount <= c + 1e-9);
    if (stale || guessed) && configured_holds && bucket.rule != Rule::Ramp {
        amount.min(bucket.capacity)
    } else {
        amount
    }
}

/// The first capacity of a bucket learned from a 429: what was sent in the last window
/// (it was too much), cut once.
pub fn first_capacity(sent_last_window: f64) -> (f64, f64) {
    let ceiling = sent_last_window.max(1.0);
    ((ceiling * DECREASE).max(1.0), ceiling)
}

/// The buckets whose capacity only 429s taught (no provider ever reported it): see
/// [`demand`].
pub fn guessed(rows: &[Learned]) -> HashSet<String> {
    rows.iter()
        .filter(|r| r.source == LearnedFrom::Throttling && r.reported.is_none())
        .map(Learned::bucket_key)
        .collect()
}

/// What one provider response said about the limits of its scope.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// The provider model's scope (`provider:oai:gpt-4o-mini`), or its key's pool's
    /// (`crate::buckets::learned_scope`).
    pub scope: String,
    pub readings: Vec<Reading>,
    /// A 429 that said nothing about capacities: learn from the 429 itself.
    pub throttled: bool,
    /// The limit such a 429's body said was met; `None`: it did not say (both the request
    /// and the token limit learn from it).
    pub bound: Option<LimitName>,
    pub at: DateTime<Utc>,
    /// The account the response named for its key, when the keyring did not know it yet.
    pub account: Option<KeyAccount>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(capacity: f64, level: f64, at: DateTime<Utc>) -> Bucket {
        Bucket {
            id: 1,
            key: "provider:oai:m:rpm".into(),
            dimension: Dimension::Requests,
            rule: Rule::Rolling,
            capacity,
            window_secs: 60,
            level,
            updated_at: at,
            resets_at: None,
            ramp_step: None,
            configured_capacity: None,
            learned_at: None,
        }
    }

    fn row(source: LearnedFrom, at: DateTime<Utc>) -> Learned {
        Learned {
            scope: "provider:oai:m".into(),
            name: LimitName::Rpm,
            reported: None,
            remaining: None,
            observed_at: at,
            throttled_at: None,
            source,
            ceiling: None,
            decreases: 0,
            changed_at: None,
            applied_at: None,
        }
    }

    #[test]
    fn a_reported_limit_sets_capacity_and_caps_the_level_and_configured_caps_it() {
        let t0 = Utc::now();
        let mut b = bucket(600.0, 500.0, t0);
        let mut r = Learned {
            reported: Some(300.0),
            ..row(LearnedFrom::Headers, t0)
        };
        apply(&mut r, &mut b, Authority::Config, t0);
        assert_eq!((b.capacity, b.level), (300.0, 300.0));
        assert!(!r.pending());
        // Configured 250 caps a reported 300 unless the provider is the authority.
        let mut b = bucket(600.0, 600.0, t0);
        b.configured_capacity = Some(250.0);
        let mut r2 = Learned {
            reported: Some(300.0),
            ..row(LearnedFrom::Headers, t0)
        };
        apply(&mut r2.clone(), &mut b, Authority::Config, t0);
        assert_eq!(b.capacity, 250.0);
        apply(&mut r2, &mut b, Authority::Provider, t0);
        assert_eq!(b.capacity, 300.0);
    }

    #[test]
    fn remaining_only_lowers_the_level_with_refill_since() {
        let t0 = Utc::now();
        let mut b = bucket(60.0, 50.0, t0);
        let mut r = Learned {
            remaining: Some(10.0),
            ..row(LearnedFrom::Headers, t0)
        };
        // Observed 2 s ago: 10 left then, 2 refilled since.
        apply(
            &mut r,
            &mut b,
            Authority::Config,
            t0 + chrono::Duration::seconds(2),
        );
        assert!((b.level - 12.0).abs() < 1e-6, "{}", b.level);
        let mut r = Learned {
            remaining: Some(59.0),
            observed_at: t0 + chrono::Duration::seconds(3),
            ..r
        };
        apply(
            &mut r,
            &mut b,
            Authority::Config,
            t0 + chrono::Duration::seconds(3),
        );
        assert!((b.level - 12.0).abs() < 1e-6, "never raised: {}", b.level);
        // Applied once: the same reading does nothing more.
        b.level = 40.0;
        apply(
            &mut r,
            &mut b,
            Authority::Config,
            t0 + chrono::Duration::seconds(4),
        );
        assert_eq!(b.level, 40.0);
    }

    #[test]
    fn a_429_spares_the_learned_limit_that_had_room_when_another_held_the_traffic_back() {
        let t0 = Utc::now();
        let mut requests = row(LearnedFrom::Throttling, t0);
        requests.throttled_at = Some(t0);
        let mut tokens = Learned {
            name: LimitName::Tpm,
            ..requests.clone()
        };
        tokens.throttled_at = Some(t0);
        let mut b_requests = bucket(100.0, 60.0, t0);
        b_requests.key = requests.bucket_key();
        let mut b_tokens = bucket(1000.0, 50.0, t0);
        b_tokens.key = tokens.bucket_key();
        let map =
            |a: &Bucket, b: &Bucket| HashMap::from([(a.key.clone(), a.clone()), (b.key.clone(), b.clone())]);
        let rows = [requests.clone(), tokens.clone()];
        // Tokens held the traffic back (5 % left): the request limit, 60 % left, is spared.
        assert_eq!(
            spared(&rows, &map(&b_requests, &b_tokens)),
            HashSet::from([requests.bucket_key()])
        );
        // Neither nearly empty: the provider is full for other reasons; both are cut.
        b_tokens.level = 500.0;
        assert!(spared(&rows, &map(&b_requests, &b_tokens)).is_empty());
        // Both nearly empty: both cut.
        b_requests.level = 10.0;
        b_tokens.level = 0.0;
        assert!(spared(&rows, &map(&b_requests, &b_tokens)).is_empty());
        // A throttle already applied spares nothing (it is not new).
        tokens.applied_at = Some(t0);
        requests.applied_at = Some(t0);
        assert!(spared(&[requests, tokens], &map(&b_requests, &b_tokens)).is_empty());
    }

    #[test]
    fn a_burst_of_429s_cuts_once_then_recovery_and_slower_probing() {
        let t0 = Utc::now();
        let mut b = bucket(100.0, 30.0, t0);
        let mut r = row(LearnedFrom::Throttling, t0);
        r.throttled_at = Some(t0);
        apply(&mut r, &mut b, Authority::Config, t0);
        assert_eq!((b.capacity, b.level, r.ceiling), (70.0, 0.0, Some(100.0)));
        // A second 429 of the same burst does not cut again.
        r.throttled_at = Some(t0 + chrono::Duration::seconds(1));
        apply(
            &mut r,
            &mut b,
            Authority::Config,
            t0 + chrono::Duration::seconds(1),
        );
        assert_eq!(b.capacity, 70.0);
        // Not saturated, or too soon: no growth.
        let later = t0 + chrono::Duration::seconds(10);
        assert!(!increase(&mut r, &mut b, false, later));
        assert!(!increase(&mut r, &mut b, true, t0 + chrono::Duration::seconds(2)));
        // Recovery: ×1.25, capped at 90 % of the ceiling.
        assert!(increase(&mut r, &mut b, true, later));
        assert_eq!(b.capacity, 87.5);
        assert!(increase(
            &mut r,
            &mut b,
            true,
            later + chrono::Duration::seconds(5)
        ));
        assert_eq!(b.capacity, 90.0);
        // Then probing: +4 % / (1 + cuts) = +2 %.
        assert!(increase(
            &mut r,
            &mut b,
            true,
            later + chrono::Duration::seconds(10)
        ));
        assert!((b.capacity - 91.8).abs() < 1e-9, "{}", b.capacity);
    }

    #[test]
    fn a_pace_doubles_once_a_second_while_it_holds_jobs_back_and_never_bursts() {
        let t0 = Utc::now();
        let spec = pace_spec("provider:oai:m", 10.0);
        let mut b = bucket(spec.capacity, 0.0, t0);
        b.window_secs = spec.window_secs;
        b.learned_at = Some(t0);
        let half = t0 + chrono::Duration::milliseconds(500);
        assert!(!pace_up(&mut b, true, half), "grew within a second");
        let second = t0 + chrono::Duration::seconds(1);
        assert!(!pace_up(&mut b, false, second), "grew with nothing held back");
        assert!(pace_up(&mut b, true, second));
        assert_eq!((b.capacity, b.level), (20.0, 0.0));
        // The doubled rate refills it: 20 a second.
        b.updated_at = second;
        b.refill(second + chrono::Duration::milliseconds(500));
        assert!((b.level - 10.0).abs() < 1e-6, "{}", b.level);
        assert!(!pace_up(
            &mut b,
            true,
            second + chrono::Duration::milliseconds(999)
        ));
        assert!(pace_up(&mut b, true, second + chrono::Duration::seconds(1)));
        assert_eq!(b.capacity, 40.0);
    }

    #[test]
    fn first_capacity_is_a_cut_of_what_was_sent() {
        assert_eq!(first_capacity(100.0), (70.0, 100.0));
        assert_eq!(first_capacity(0.0), (1.0, 1.0));
    }
}
