//! Per-project rate limiting: continuous-refill token buckets for the per-minute limits
//! (RPM, TPM, ITPM, OTPM) and a fixed UTC-day window for RPD, combined in a [`Limiter`]
//! that admits a request all-or-nothing and reports what the headers need.
//!
//! Buckets use exact integer arithmetic: a level is stored in units of
//! 1/[`NS_PER_MIN`] token, so refilling `cap` tokens per minute adds exactly `cap` units per
//! nanosecond and no rounding drift can let a bucket over-admit. Every admission and
//! refund is also fed to the independent [`Audit`].

use super::audit::Audit;
use super::clock::Clock;
use super::config::ProjectLimits;

/// Nanoseconds per minute; also the number of level units per token.
pub(crate) const NS_PER_MIN: u128 = 60_000_000_000;
/// Nanoseconds per day, for the RPD window.
pub(crate) const NS_PER_DAY: i128 = 86_400_000_000_000;

/// Which limit a rejection (or header) is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitKind {
    /// Requests per minute.
    Rpm,
    /// Requests per UTC day.
    Rpd,
    /// Tokens (input + max output) per minute.
    Tpm,
    /// Input tokens per minute.
    Itpm,
    /// Output tokens per minute.
    Otpm,
}

/// One limit as the headers show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BucketView {
    /// Capacity (per minute, or per day for RPD).
    pub limit: u64,
    /// Whole units left now.
    pub remaining: u64,
    /// Nanoseconds until the limit is back to full (OpenAI's "reset" meaning).
    pub reset_ns: u64,
}

/// All limits of a project at one instant; `None` = unlimited.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LimitsView {
    pub rpm: Option<BucketView>,
    pub rpd: Option<BucketView>,
    pub tpm: Option<BucketView>,
    pub itpm: Option<BucketView>,
    pub otpm: Option<BucketView>,
    /// Unix time of the view, in ns (for absolute reset stamps).
    pub unix_ns: i128,
}

/// What one request costs. Every request also costs one unit of RPM and RPD.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Charge {
    /// Charged to TPM: input + max output.
    pub tokens: u64,
    /// Charged to ITPM.
    pub input: u64,
    /// Reserved on OTPM: max output (corrected later with [`Limiter::refund_output`]).
    pub output: u64,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Denial {
    /// The limit reported in the message: the one with the longest wait, or the one
    /// the request can never fit in.
    pub kind: LimitKind,
    pub limit: u64,
    /// `limit - remaining` of that limit.
    pub used: u64,
    /// What the request asked of that limit.
    pub requested: u64,
    /// Nanoseconds until every limit can take the request (0 when `too_large`).
    pub wait_ns: u64,
    /// The request is larger than the limit's capacity: retrying cannot help.
    pub too_large: bool,
}

/// Result of [`Limiter::try_admit`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Admission {
    Admitted(LimitsView),
    Denied(Denial, LimitsView),
}

/// Continuous-refill bucket: capacity `cap` per minute, refilled `cap/60` per second,
/// starts full.
#[derive(Debug, Clone)]
struct Bucket {
    cap: u64,
    /// Level in 1/NS_PER_MIN token units, `0..=cap*NS_PER_MIN`.
    level: u128,
    last_ns: u64,
}

impl Bucket {
    fn full(cap: u64, now_ns: u64) -> Self {
        Self {
            cap,
            level: u128::from(cap) * NS_PER_MIN,
            last_ns: now_ns,
        }
    }

    fn max_level(&self) -> u128 {
        u128::from(self.cap) * NS_PER_MIN
    }

    fn refill(&mut self, now_ns: u64) {
        if now_ns > self.last_ns {
            let added = u128::from(self.cap) * u128::from(now_ns - self.last_ns);
            self.level = self.level.saturating_add(added).min(self.max_level());
            self.last_ns = now_ns;
        }
    }

    /// `None` if `n` fits now, else the nanoseconds until it does (`n <= cap` assumed).
    fn wait_for(&self, n: u64) -> Option<u64> {
        let need = u128::from(n) * NS_PER_MIN;
        if need <= self.level {
            return None;
        }
        Some(ceil_ns((need - self.level).div_ceil(u128::from(self.cap.max(1)))))
    }

    fn take(&mut self, n: u64) {
        self.level = self.level.saturating_sub(u128::from(n) * NS_PER_MIN);
    }

    fn give(&mut self, n: u64) {
        self.level = self
            .level
            .saturating_add(u128::from(n) * NS_PER_MIN)
            .min(self.max_level());
    }

    fn set_cap(&mut self, cap: u64) {
        self.cap = cap;
        self.level = self.level.min(self.max_level());
    }

    fn view(&self) -> BucketView {
        let missing = self.max_level() - self.level;
        BucketView {
            limit: self.cap,
            remaining: u64::try_from(self.level / NS_PER_MIN).unwrap_or(u64::MAX),
            reset_ns: ceil_ns(missing.div_ceil(u128::from(self.cap.max(1)))),
        }
    }
}

fn ceil_ns(ns: u128) -> u64 {
    u64::try_from(ns).unwrap_or(u64::MAX)
}

/// Requests per UTC day, resetting at midnight.
#[derive(Debug, Clone)]
struct DayWindow {
    limit: u64,
    day: i128,
    count: u64,
}

impl DayWindow {
    fn roll(&mut self, unix_ns: i128) {
        let day = unix_ns.div_euclid(NS_PER_DAY);
        if day != self.day {
            self.day = day;
            self.count = 0;
        }
    }

    fn until_midnight(&self, unix_ns: i128) -> u64 {
        let next = (self.day + 1) * NS_PER_DAY;
        u64::try_from((next - unix_ns).max(0)).unwrap_or(u64::MAX)
    }

    fn view(&self, unix_ns: i128) -> BucketView {
        BucketView {
            limit: self.limit,
            remaining: self.limit.saturating_sub(self.count),
            reset_ns: if self.count == 0 {
                0
            } else {
                self.until_midnight(unix_ns)
            },
        }
    }
}

/// All limits of one project plus their audit. Lives behind the project's mutex; every
/// method reads the clock itself so that time never goes backwards between callers.
#[derive(Debug)]
pub(crate) struct Limiter {
    limits: ProjectLimits,
    rpm: Option<Bucket>,
    tpm: Option<Bucket>,
    itpm: Option<Bucket>,
    otpm: Option<Bucket>,
    rpd: Option<DayWindow>,
    audit: Audit,
}

fn bucket(cap: u64, now_ns: u64) -> Option<Bucket> {
    (cap > 0).then(|| Bucket::full(cap, now_ns))
}

/// Applies a new capacity to an optional bucket: new buckets start full, existing
/// ones keep their level clamped to the new capacity, 0 removes the bucket.
fn resize(slot: &mut Option<Bucket>, cap: u64, now_ns: u64) {
    match (slot.as_mut(), cap) {
        (_, 0) => *slot = None,
        (Some(b), cap) => {
            b.refill(now_ns);
            b.set_cap(cap);
        }
        (None, cap) => *slot = Some(Bucket::full(cap, now_ns)),
    }
}

impl Limiter {
    pub(crate) fn new(limits: ProjectLimits, clock: &Clock) -> Self {
        let now = clock.now_ns();
        let unix = clock.unix_ns_at(now);
        Self {
            limits,
            rpm: bucket(limits.rpm, now),
            tpm: bucket(limits.tpm, now),
            itpm: bucket(limits.itpm, now),
            otpm: bucket(limits.otpm, now),
            rpd: (limits.rpd > 0).then(|| DayWindow {
                limit: limits.rpd,
                day: unix.div_euclid(NS_PER_DAY),
                count: 0,
            }),
            audit: Audit::new(&limits),
        }
    }

    pub(crate) fn limits(&self) -> ProjectLimits {
        self.limits
    }

    pub(crate) fn violations(&self) -> u64 {
        self.audit.violations()
    }

    /// Forgets the audit history and violation count (`/mock/reset`).
    pub(crate) fn reset_audit(&mut self) {
        self.audit.restart(&self.limits, true);
    }

    /// Changes the limits at run time. Buckets keep their level, clamped to the new
    /// capacity; the RPD window keeps today's count.
    pub(crate) fn set_limits(&mut self, limits: ProjectLimits, clock: &Clock) {
        let now = clock.now_ns();
        let unix = clock.unix_ns_at(now);
        resize(&mut self.rpm, limits.rpm, now);
        resize(&mut self.tpm, limits.tpm, now);
        resize(&mut self.itpm, limits.itpm, now);
        resize(&mut self.otpm, limits.otpm, now);
        self.rpd = match (self.rpd.take(), limits.rpd) {
            (_, 0) => None,
            (Some(mut w), limit) => {
                w.roll(unix);
                w.limit = limit;
                Some(w)
            }
            (None, limit) => Some(DayWindow {
                limit,
                day: unix.div_euclid(NS_PER_DAY),
                count: 0,
            }),
        };
        self.limits = limits;
        // A capacity change starts a new audit epoch: the old bound no longer applies.
        self.audit.restart(&limits, false);
    }

    fn refill(&mut self, now: u64, unix: i128) {
        for b in [&mut self.rpm, &mut self.tpm, &mut self.itpm, &mut self.otpm]
            .into_iter()
            .flatten()
        {
            b.refill(now);
        }
        if let Some(w) = &mut self.rpd {
            w.roll(unix);
        }
    }

    fn view_at(&self, unix: i128) -> LimitsView {
        LimitsView {
            rpm: self.rpm.as_ref().map(Bucket::view),
            rpd: self.rpd.as_ref().map(|w| w.view(unix)),
            tpm: self.tpm.as_ref().map(Bucket::view),
            itpm: self.itpm.as_ref().map(Bucket::view),
            otpm: self.otpm.as_ref().map(Bucket::view),
            unix_ns: unix,
        }
    }

    /// Current state without charging anything (for responses that are not admissions).
    pub(crate) fn view(&mut self, clock: &Clock) -> LimitsView {
        let now = clock.now_ns();
        let unix = clock.unix_ns_at(now);
        self.refill(now, unix);
        self.view_at(unix)
    }

    /// Admits the request if every limit can take it, charging all of them; otherwise
    /// charges nothing and says which limit is in the way.
    pub(crate) fn try_admit(&mut self, charge: Charge, clock: &Clock) -> Admission {
        let now = clock.now_ns();
        let unix = clock.unix_ns_at(now);
        self.refill(now, unix);

        let buckets = [
            (LimitKind::Rpm, self.rpm.as_ref(), 1),
            (LimitKind::Tpm, self.tpm.as_ref(), charge.tokens),
            (LimitKind::Itpm, self.itpm.as_ref(), charge.input),
            (LimitKind::Otpm, self.otpm.as_ref(), charge.output),
        ];
        let mut worst: Option<Denial> = None;
        for (kind, b, n) in buckets {
            let Some(b) = b else { continue };
            let used = b.cap.saturating_sub(b.view().remaining);
            if n > b.cap {
                let denial = Denial {
                    kind,
                    limit: b.cap,
                    used,
                    requested: n,
                    wait_ns: 0,
                    too_large: true,
                };
                return Admission::Denied(denial, self.view_at(unix));
            }
            match b.wait_for(n) {
                Some(wait_ns) if worst.is_none_or(|w| wait_ns > w.wait_ns) => {
                    worst = Some(Denial {
                        kind,
                        limit: b.cap,
                        used,
                        requested: n,
                        wait_ns,
                        too_large: false,
                    });
                }
                _ => {}
            }
        }
        if let Some(w) = self.rpd.as_ref().filter(|w| w.count >= w.limit) {
            let wait_ns = w.until_midnight(unix);
            if worst.is_none_or(|d| wait_ns > d.wait_ns) {
                worst = Some(Denial {
                    kind: LimitKind::Rpd,
                    limit: w.limit,
                    used: w.count,
                    requested: 1,
                    wait_ns,
                    too_large: false,
                });
            }
        }
        if let Some(denial) = worst {
            return Admission::Denied(denial, self.view_at(unix));
        }

        let takes = [
            (LimitKind::Rpm, &mut self.rpm, 1),
            (LimitKind::Tpm, &mut self.tpm, charge.tokens),
            (LimitKind::Itpm, &mut self.itpm, charge.input),
            (LimitKind::Otpm, &mut self.otpm, charge.output),
        ];
        for (kind, b, n) in takes {
            if let Some(b) = b {
                b.take(n);
                self.audit.record(kind, now, unix, i128::from(n));
            }
        }
        if let Some(w) = &mut self.rpd {
            w.count += 1;
            self.audit.record(LimitKind::Rpd, now, unix, 1);
        }
        Admission::Admitted(self.view_at(unix))
    }

    /// Returns `n` reserved output tokens to OTPM (the request generated fewer than its
    /// `max_tokens`).
    pub(crate) fn refund_output(&mut self, n: u64, clock: &Clock) {
        if n == 0 {
            return;
        }
        let now = clock.now_ns();
        let unix = clock.unix_ns_at(now);
        if let Some(b) = &mut self.otpm {
            b.refill(now);
            b.give(n);
            self.audit.record(LimitKind::Otpm, now, unix, -i128::from(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_refills_continuously_and_caps() {
        let mut b = Bucket::full(60, 0);
        b.take(60);
        assert_eq!(b.view().remaining, 0);
        assert_eq!(b.view().reset_ns, 60_000_000_000);
        assert_eq!(b.wait_for(1), Some(1_000_000_000));
        b.refill(500_000_000);
        assert_eq!(b.view().remaining, 0);
        assert_eq!(b.wait_for(1), Some(500_000_000));
        b.refill(10 * 60_000_000_000);
        assert_eq!(b.view().remaining, 60);
        assert_eq!(b.view().reset_ns, 0);
    }

    #[test]
    fn set_cap_clamps_level() {
        let mut b = Bucket::full(100, 0);
        b.set_cap(50);
        assert_eq!(b.view().remaining, 50);
        b.set_cap(200);
        assert_eq!(b.view().remaining, 50);
        assert_eq!(b.view().limit, 200);
    }
}
