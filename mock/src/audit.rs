//! Independent check that the mock never admits more than its limits allow; it guards
//! the mock itself (a broker benchmark is worthless if the mock over-admits).
//!
//! For a per-minute limit `C` (refill `C` per 60 s, burst `C`), whatever is admitted in
//! any window `[t_i, t_j]` — from the admission at `t_i` through the one at `t_j`, net of
//! OTPM refunds — must be at most `C + C·(t_j − t_i)/60 s`. This holds for every window,
//! so in particular for every trailing 60 s window (bound `2C`). The audit keeps the
//! admission log in summarised form: with `A_k` the running sum of amounts and
//! `Q_i = A_{i−1}·60 s − C·t_i`, the worst window ending at event `j` is
//! `A_j·60 s − C·t_j − min_{i≤j} Q_i`, so one running minimum checks every window in
//! O(1) per event, in exact integers. It never looks at the buckets' levels.
//!
//! RPD is checked with its own per-UTC-day counter. A limit change (`set_limits`) starts
//! a new epoch, since the old bound no longer applies.

use super::buckets::{LimitKind, NS_PER_DAY, NS_PER_MIN};
use super::config::ProjectLimits;

/// Running summary of one per-minute limit's admission log.
#[derive(Debug, Clone)]
struct IntervalAudit {
    cap: i128,
    /// Sum of admitted amounts so far (refunds negative).
    total: i128,
    /// `min_i Q_i` over the epoch; `None` before the first event.
    min_q: Option<i128>,
}

impl IntervalAudit {
    fn new(cap: u64) -> Option<Self> {
        (cap > 0).then(|| Self {
            cap: i128::from(cap),
            total: 0,
            min_q: None,
        })
    }

    /// Records `amount` admitted at `t_ns`; true if some window ending now exceeds the bound.
    fn record(&mut self, t_ns: u64, amount: i128) -> bool {
        let per_min = NS_PER_MIN as i128;
        let t = i128::from(t_ns);
        let q = self.total * per_min - self.cap * t;
        let min_q = self.min_q.map_or(q, |m| m.min(q));
        self.min_q = Some(min_q);
        self.total += amount;
        let worst = self.total * per_min - self.cap * t - min_q;
        worst > self.cap * per_min
    }
}

/// Requests per UTC day, counted independently of the limiter's window.
#[derive(Debug, Clone)]
struct DayAudit {
    limit: u64,
    day: i128,
    count: u64,
}

/// The audit of one project.
#[derive(Debug, Clone)]
pub(crate) struct Audit {
    rpm: Option<IntervalAudit>,
    tpm: Option<IntervalAudit>,
    itpm: Option<IntervalAudit>,
    otpm: Option<IntervalAudit>,
    rpd: Option<DayAudit>,
    violations: u64,
}

impl Audit {
    pub(crate) fn new(limits: &ProjectLimits) -> Self {
        Self {
            rpm: IntervalAudit::new(limits.rpm),
            tpm: IntervalAudit::new(limits.tpm),
            itpm: IntervalAudit::new(limits.itpm),
            otpm: IntervalAudit::new(limits.otpm),
            rpd: (limits.rpd > 0).then_some(DayAudit {
                limit: limits.rpd,
                day: i128::MIN,
                count: 0,
            }),
            violations: 0,
        }
    }

    /// Starts a new epoch with `limits`; today's request count carries over (the limiter's
    /// day window keeps it too). `clear_violations` also zeroes the count of violations.
    pub(crate) fn restart(&mut self, limits: &ProjectLimits, clear_violations: bool) {
        let day = self.rpd.as_ref().map(|d| (d.day, d.count));
        let violations = if clear_violations { 0 } else { self.violations };
        *self = Self::new(limits);
        self.violations = violations;
        if let (Some(d), Some((day, count))) = (self.rpd.as_mut(), day) {
            d.day = day;
            d.count = count;
        }
    }

    pub(crate) fn violations(&self) -> u64 {
        self.violations
    }

    /// Logs `amount` of `kind` admitted (negative: refunded) at `t_ns` / `unix_ns`.
    pub(crate) fn record(&mut self, kind: LimitKind, t_ns: u64, unix_ns: i128, amount: i128) {
        let violated = match kind {
            LimitKind::Rpm => self.rpm.as_mut().is_some_and(|a| a.record(t_ns, amount)),
            LimitKind::Tpm => self.tpm.as_mut().is_some_and(|a| a.record(t_ns, amount)),
            LimitKind::Itpm => self.itpm.as_mut().is_some_and(|a| a.record(t_ns, amount)),
            LimitKind::Otpm => self.otpm.as_mut().is_some_and(|a| a.record(t_ns, amount)),
            LimitKind::Rpd => self.rpd.as_mut().is_some_and(|d| {
                let day = unix_ns.div_euclid(NS_PER_DAY);
                if day != d.day {
                    d.day = day;
                    d.count = 0;
                }
                d.count = d.count.saturating_add_signed(i64::try_from(amount).unwrap_or(0));
                d.count > d.limit
            }),
        };
        if violated {
            self.violations += 1;
            tracing::error!(?kind, "mock provider admitted more than its limit allows");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn limits(rpm: u64) -> ProjectLimits {
        ProjectLimits {
            rpm,
            ..ProjectLimits::default()
        }
    }

    #[test]
    fn a_full_burst_then_steady_refill_is_fine() {
        let mut a = Audit::new(&limits(60));
        for _ in 0..60 {
            a.record(LimitKind::Rpm, 0, 0, 1);
        }
        for s in 1..=120 {
            a.record(LimitKind::Rpm, s * SEC, 0, 1);
        }
        assert_eq!(a.violations(), 0);
    }

    #[test]
    fn detects_over_admission_in_a_burst() {
        let mut a = Audit::new(&limits(60));
        for _ in 0..61 {
            a.record(LimitKind::Rpm, 5 * SEC, 0, 1);
        }
        assert_eq!(a.violations(), 1);
    }

    #[test]
    fn detects_refill_faster_than_allowed() {
        let mut a = Audit::new(&limits(60));
        for _ in 0..60 {
            a.record(LimitKind::Rpm, 0, 0, 1);
        }
        // Two more after one second: only one has been refilled.
        a.record(LimitKind::Rpm, SEC, 0, 1);
        a.record(LimitKind::Rpm, SEC, 0, 1);
        assert_eq!(a.violations(), 1);
    }

    #[test]
    fn idle_time_does_not_accumulate_beyond_capacity() {
        let mut a = Audit::new(&limits(60));
        a.record(LimitKind::Rpm, 0, 0, 1);
        // Ten idle minutes, then a burst of capacity + 1 within one instant.
        for _ in 0..61 {
            a.record(LimitKind::Rpm, 600 * SEC, 0, 1);
        }
        assert_eq!(a.violations(), 1);
    }

    #[test]
    fn refunds_make_room() {
        let mut a = Audit::new(&ProjectLimits {
            otpm: 100,
            ..ProjectLimits::default()
        });
        a.record(LimitKind::Otpm, 0, 0, 100);
        a.record(LimitKind::Otpm, 0, 0, -50);
        a.record(LimitKind::Otpm, 0, 0, 50);
        assert_eq!(a.violations(), 0);
        a.record(LimitKind::Otpm, 0, 0, 1);
        assert_eq!(a.violations(), 1);
    }

    #[test]
    fn day_counter_resets_at_midnight() {
        let mut a = Audit::new(&ProjectLimits {
            rpd: 2,
            ..ProjectLimits::default()
        });
        let day = NS_PER_DAY;
        a.record(LimitKind::Rpd, 0, day - 1, 1);
        a.record(LimitKind::Rpd, 0, day - 1, 1);
        a.record(LimitKind::Rpd, 0, day, 1);
        a.record(LimitKind::Rpd, 0, day, 1);
        assert_eq!(a.violations(), 0);
        a.record(LimitKind::Rpd, 0, day + 5, 1);
        assert_eq!(a.violations(), 1);
    }
}
