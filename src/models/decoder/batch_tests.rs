//! The slot pool's buckets: which are warmed, what a prompt's bucket attends over.

use super::{bucket, prompt_spans, rows_go_in_a_bucket, warm_buckets};

#[test]
fn the_warm_up_makes_every_bucket_a_step_asks_for() {
    assert_eq!(warm_buckets(16, 0), [1, 2, 4, 8, 16]);
    assert_eq!(warm_buckets(17, 128), [1, 2, 4, 8, 16, 17, 32, 64, 128]);
    assert_eq!(warm_buckets(64, 100), [1, 2, 4, 8, 16, 32, 64, 100]);
    assert_eq!(warm_buckets(64, 32), [1, 2, 4, 8, 16, 32, 64], "prompts within the slots");
    for (slots, prefill) in [(17, 128), (64, 100), (16, 0), (3, 32)] {
        let warm = warm_buckets(slots, prefill);
        for n in 1..=slots {
            assert!(warm.contains(&bucket(n, slots)), "{n} decode rows of {slots} slots");
        }
        for n in 1..=prefill.max(slots) {
            let b = bucket(n, prefill.max(slots));
            assert!(warm.contains(&b), "{n} prompt rows: bucket {b}, warmed {warm:?}");
        }
    }
}

#[test]
fn a_long_conversations_prompt_stays_out_of_the_buckets() {
    assert!(rows_go_in_a_bucket(600, 90), "a short conversation's turn");
    assert!(rows_go_in_a_bucket(6000, 1), "a decode row at any position");
    assert!(!rows_go_in_a_bucket(2000, 90), "a prompt ending past 2048 positions");
}

#[test]
fn a_prompt_bucket_attends_over_powers_of_two_up_to_the_slot() {
    assert_eq!(prompt_spans(4096), [256, 512, 1024, 2048, 4096]);
    assert_eq!(prompt_spans(3000), [256, 512, 1024, 2048, 3000], "the slot's own size last");
    assert_eq!(prompt_spans(64), [64], "a slot smaller than the least span");
}
