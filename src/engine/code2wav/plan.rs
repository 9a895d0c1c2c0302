//! Which chunks run in a Code2Wav step: each chunk's due time (from its stream's playback
//! deadline), the horizon a step may run ahead, and the chunks a step leaves to the next one
//! (first chunks apart, one batch a step).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::ChunkWork;

/// When a chunk is due to start: a stream that plays, one step (`lead`, the recent step time)
/// before its listener's buffer runs dry; a chunk 0 (nothing played yet) as soon as it came, since
/// first audio is due at once. Earliest first, chunk 0s among the others: a playing stream whose
/// buffer runs dry within a step goes before the chunk 0s that came after that moment, so a
/// small first chunk's next one does not wait behind every newer stream's chunk 0.
pub(super) fn due(deadline: Option<Instant>, queued: Instant, lead: Duration) -> Instant {
    match deadline {
        Some(d) => d.checked_sub(lead).unwrap_or(d),
        None => queued,
    }
}

/// How far ahead of its due time a chunk may run: two recent steps, and never less than
/// [`MIN_HORIZON`] (a step may take longer than the recent ones, as when new voices join it).
pub(super) fn horizon(step_estimate: Duration) -> Duration {
    (step_estimate * 2).max(MIN_HORIZON)
}

const MIN_HORIZON: Duration = Duration::from_millis(300);

/// How many of the chunks (due times sorted, earliest first) run in this step: those due within
/// `horizon` of `now`, at most `max`.
pub(super) fn due_within(dues: &[Instant], now: Instant, horizon: Duration, max: usize) -> usize {
    dues.iter().take(max).take_while(|&&d| d <= now + horizon).count()
}

/// Which chunks of a step (`seqs` and `dues` in step order) go to the step right after: when the
/// step holds a first chunk (seq 0), every later chunk not due within `horizon` of `now` (its
/// stream has audio buffered beyond it); otherwise none.
pub(super) fn first_chunks_apart(
    seqs: &[usize],
    dues: &[Instant],
    now: Instant,
    horizon: Duration,
) -> Vec<bool> {
    let firsts = seqs.contains(&0);
    seqs.iter().zip(dues).map(|(&s, &d)| firsts && s > 0 && d > now + horizon).collect()
}

/// Which chunks of a step (their (chunk length, last) shapes in step order, earliest due first)
/// go back to the queue when a step runs one batch: every chunk whose shape differs from the
/// first's (the earliest-due chunk's batch runs now).
pub(super) fn other_batches(shapes: &[(usize, bool)]) -> Vec<bool> {
    shapes.iter().map(|s| Some(s) != shapes.first()).collect()
}

/// The chunks of `ready` not marked in `later` (in their order); the marked ones go back to the
/// front of `rest`, in their order, for a later step.
pub(super) fn put_back(
    ready: Vec<ChunkWork>,
    later: &[bool],
    rest: &mut VecDeque<ChunkWork>,
) -> Vec<ChunkWork> {
    let (mut now_run, mut after) = (Vec::with_capacity(ready.len()), Vec::new());
    for (c, &l) in ready.into_iter().zip(later) {
        if l {
            after.push(c);
        } else {
            now_run.push(c);
        }
    }
    for c in after.into_iter().rev() {
        rest.push_front(c);
    }
    now_run
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A playing stream whose buffer runs dry within a step goes before a chunk 0 that came just
    /// now; one with a second of audio left goes after it; chunk 0s keep their arrival order.
    #[test]
    fn chunks_due_before_a_buffer_runs_dry_go_first() {
        let now = Instant::now();
        let lead = Duration::from_millis(300);
        let chunk0_early = due(None, now, lead);
        let chunk0_late = due(None, now + Duration::from_millis(50), lead);
        let dry_soon =
            due(Some(now + Duration::from_millis(200)), now - Duration::from_secs(1), lead);
        let dry_later = due(Some(now + Duration::from_secs(1)), now - Duration::from_secs(1), lead);
        assert!(dry_soon < chunk0_early && chunk0_early < chunk0_late && chunk0_late < dry_later);
    }

    /// With first chunks apart, a step holding a chunk 0 leaves the chunks with audio buffered
    /// beyond its horizon to the next step; one that holds none keeps them all.
    #[test]
    fn first_chunks_leave_the_buffered_chunks_to_the_next_step() {
        let now = Instant::now();
        let ms = |m: u64| now + Duration::from_millis(m);
        let h = Duration::from_millis(300);
        let dues = [ms(0), ms(100), ms(299), ms(301), ms(2000)];
        assert_eq!(
            first_chunks_apart(&[1, 0, 2, 3, 1], &dues, now, h),
            [false, false, false, true, true]
        );
        assert_eq!(
            first_chunks_apart(&[1, 4, 2, 3, 1], &dues, now, h),
            [false; 5],
            "no first chunk: one step"
        );
        assert_eq!(
            first_chunks_apart(&[0, 0], &dues[3..], now, h),
            [false, false],
            "first chunks never wait"
        );
    }

    /// One batch a step: the earliest-due chunk's shape runs, every chunk of another shape waits
    /// for the next step, wherever it stands in the order.
    #[test]
    fn one_batch_a_step_is_the_earliest_due_chunks_batch() {
        let shapes = [(28, false), (28, true), (28, false), (11, false), (28, false)];
        assert_eq!(other_batches(&shapes), [false, true, false, true, false]);
        assert_eq!(
            other_batches(&[(28, true), (28, false)]),
            [false, true],
            "a last chunk due first runs first"
        );
        assert_eq!(other_batches(&[]), Vec::<bool>::new());
    }

    /// A step takes the chunks due within its horizon (at most the batch), so a stream with
    /// seconds buffered waits for a later step and a chunk 0 never waits behind it.
    #[test]
    fn a_step_takes_only_what_is_due_within_its_horizon() {
        let now = Instant::now();
        let ms = |m: u64| now + Duration::from_millis(m);
        let h = horizon(Duration::from_millis(100));
        assert_eq!(h, MIN_HORIZON, "never less than the floor");
        assert_eq!(horizon(Duration::from_millis(400)), Duration::from_millis(800));
        let dues = [now, ms(100), ms(299), ms(301), ms(2000)];
        assert_eq!(due_within(&dues, now, h, 8), 3);
        assert_eq!(due_within(&dues, now, h, 2), 2, "at most the batch");
        assert_eq!(due_within(&[ms(900)], now, h, 8), 0, "nothing due: the step waits");
    }
}
