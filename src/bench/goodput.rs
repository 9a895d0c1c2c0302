//! Goodput: the highest load a run's levels show the service still good at — the highest
//! concurrency (closed-loop workloads) or arrival rate (`conversations`) at which TTFA p95 is at
//! most 800 ms, at least 99 % of the completed responses played without a stall (no pre-buffer),
//! the server refused no call and no reply, and no request failed.

use serde::{Deserialize, Serialize};

use super::report::LevelSummary;
use super::Workload;

/// TTFA p95 at most this (ms).
pub const TTFA_P95_MAX_MS: f64 = 800.0;
/// At least this fraction of the completed responses without a stall event (no pre-buffer).
pub const WITHOUT_STALL_MIN_FRAC: f64 = 0.99;

/// A run's goodput, in `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Goodput {
    /// What a level must meet, in words.
    pub criterion: String,
    /// The highest level that meets it (a rate or a concurrency); none when no level does.
    pub level: Option<f64>,
    /// "conversations/s" or "concurrent sessions".
    pub unit: String,
    /// Duplex: the most live sessions at once whose audio all played without a stall (no
    /// pre-buffer), with none refused and none failed, whatever their first audio: how many duplex
    /// sessions the replica holds. None when no level does, and for other workloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions_held: Option<f64>,
}

/// The level's place on the load axis: its arrival rate, else its concurrency.
pub fn level_value(l: &LevelSummary) -> f64 {
    l.rate_per_s.unwrap_or(l.concurrency as f64)
}

/// The fraction of the completed responses that played without a stall. A summary written before
/// the figure existed bounds it from below by its stall events (at most one response each).
pub fn without_stall_frac(l: &LevelSummary) -> Option<f64> {
    let completed = l.requests.saturating_sub(l.failures);
    match l.responses_without_stall_frac {
        Some(f) => Some(f),
        None if completed > 0 => Some((1.0 - l.stall_events as f64 / completed as f64).max(0.0)),
        None => None,
    }
}

/// Whether a level served everything it was asked: some responses completed, none failed, and
/// the server refused no call and no reply.
fn served_all(l: &LevelSummary) -> bool {
    let completed = l.requests.saturating_sub(l.failures);
    let refused = l.calls_refused.unwrap_or(0)
        + l.replies_refused.unwrap_or(0)
        + l.failures_by_code.get("capacity").copied().unwrap_or(0);
    completed > 0 && l.failures == 0 && refused == 0
}

/// Whether one level meets the criterion (a level with no completed response does not).
pub fn meets(l: &LevelSummary) -> bool {
    served_all(l)
        && l.ttfa_ms.p95 <= TTFA_P95_MAX_MS
        && without_stall_frac(l).is_some_and(|f| f >= WITHOUT_STALL_MIN_FRAC)
}

/// Whether a duplex level's sessions were all held: every reply without a stall, none refused,
/// none failed (a level with no completed reply is not).
pub fn holds(l: &LevelSummary) -> bool {
    served_all(l) && l.stall_events == 0
}

fn highest<'a>(levels: impl Iterator<Item = &'a LevelSummary>) -> Option<f64> {
    levels.map(level_value).fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
}

/// The goodput of a run's levels.
pub fn of(workload: Workload, levels: &[LevelSummary]) -> Goodput {
    let unit =
        if workload == Workload::Conversations { "conversations/s" } else { "concurrent sessions" };
    let level = highest(levels.iter().filter(|l| meets(l)));
    let sessions_held = if workload == Workload::Duplex {
        highest(levels.iter().filter(|l| holds(l)))
    } else {
        None
    };
    Goodput {
        criterion: format!(
            "TTFA p95 <= {TTFA_P95_MAX_MS:.0} ms, >= {:.0}% of completed responses without a \
            stall (no pre-buffer), no call or reply refused, no request failed",
            WITHOUT_STALL_MIN_FRAC * 100.0
        ),
        level,
        unit: unit.into(),
        sessions_held,
    }
}

#[cfg(test)]
mod tests {
    use super::super::report::Percentiles;
    use super::*;

    fn level(concurrency: usize, p95: f64, stalled: usize) -> LevelSummary {
        LevelSummary {
            concurrency,
            requests: 100,
            ttfa_ms: Percentiles { mean: p95 / 2.0, p50: p95 / 2.0, p90: p95, p95, p99: p95 },
            stall_events: stalled,
            responses_without_stall_frac: Some(1.0 - stalled as f64 / 100.0),
            ..Default::default()
        }
    }

    #[test]
    fn the_highest_concurrency_that_meets_every_bound() {
        let levels = vec![
            level(1, 300.0, 0),
            level(2, 500.0, 1),
            level(4, 790.0, 0),
            level(8, 900.0, 0),
            level(16, 2000.0, 30),
        ];
        let g = of(Workload::Tts, &levels);
        assert_eq!(g.level, Some(4.0));
        assert_eq!(g.unit, "concurrent sessions");
        assert!(g.criterion.contains("800 ms") && g.criterion.contains("99%"), "{}", g.criterion);
        // two stalled responses in 100 is below 99 % without a stall
        assert!(!meets(&level(2, 500.0, 2)));
        // the highest that meets it, even above one that does not
        let g = of(Workload::Duplex, &[level(1, 900.0, 0), level(2, 700.0, 0)]);
        assert_eq!(g.level, Some(2.0));
        // nothing meets it
        assert_eq!(of(Workload::Tts, &[level(1, 801.0, 0)]).level, None);
        assert_eq!(of(Workload::Tts, &[]).level, None);
    }

    #[test]
    fn refusals_failures_and_empty_levels_miss_it() {
        let ok = level(1, 300.0, 0);
        assert!(meets(&ok));
        assert!(!meets(&LevelSummary { calls_refused: Some(1), ..ok.clone() }));
        assert!(!meets(&LevelSummary { replies_refused: Some(1), failures: 1, ..ok.clone() }));
        assert!(!meets(&LevelSummary { failures: 1, ..ok.clone() }));
        assert!(!meets(&LevelSummary {
            requests: 0,
            responses_without_stall_frac: None,
            ..ok.clone()
        }));
        // an old summary: the stall events bound the fraction (1 in 100 = 99 %)
        assert!(meets(&LevelSummary {
            responses_without_stall_frac: None,
            stall_events: 1,
            ..ok.clone()
        }));
        assert!(!meets(&LevelSummary {
            responses_without_stall_frac: None,
            stall_events: 2,
            ..ok
        }));
    }

    /// Duplex: the sessions held are the highest level with no stall at all, whatever its first
    /// audio (C64 at 1.8 s p95 counts); one stall, one refusal or one failure and it does not.
    #[test]
    fn duplex_sessions_held_are_the_highest_level_without_a_stall() {
        let levels = vec![
            level(16, 600.0, 0),
            level(32, 750.0, 0),
            level(64, 1800.0, 0),
            level(96, 9000.0, 1),
        ];
        let g = of(Workload::Duplex, &levels);
        assert_eq!((g.level, g.sessions_held), (Some(32.0), Some(64.0)));
        let refused = LevelSummary { calls_refused: Some(1), ..level(64, 1800.0, 0) };
        assert_eq!(of(Workload::Duplex, &[level(16, 600.0, 0), refused]).sessions_held, Some(16.0));
        assert_eq!(of(Workload::Duplex, &[level(8, 600.0, 1)]).sessions_held, None);
        assert_eq!(of(Workload::Tts, &levels).sessions_held, None, "duplex only");
        // (an old summary without the figure reads as none)
        let old: Goodput =
            serde_json::from_str(r#"{"criterion":"c","level":null,"unit":"u"}"#).unwrap();
        assert_eq!(old.sessions_held, None);
    }

    #[test]
    fn rates_are_the_levels_of_the_conversations_workload() {
        let at = |rate: f64, p95: f64| LevelSummary {
            rate_per_s: Some(rate),
            calls_offered: Some(100),
            calls_refused: Some(0),
            ..level(7, p95, 0)
        };
        let g = of(Workload::Conversations, &[at(2.0, 300.0), at(4.0, 600.0), at(8.0, 1500.0)]);
        assert_eq!(g.level, Some(4.0));
        assert_eq!(g.unit, "conversations/s");
        let refused = LevelSummary { calls_refused: Some(3), ..at(4.0, 600.0) };
        assert_eq!(of(Workload::Conversations, &[at(2.0, 300.0), refused]).level, Some(2.0));
        assert_eq!(level_value(&at(0.5, 1.0)), 0.5);
    }
}
