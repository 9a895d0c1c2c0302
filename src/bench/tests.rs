use super::*;

#[test]
fn stall_model() {
    let d = vec![20.0; 5];
    // packets every 20 ms: no stall
    assert_eq!(stalls(&[0.0, 20.0, 40.0, 60.0, 80.0], &d, 0.0), (0, 0.0));
    // a 70 ms gap after the third packet: the buffer is dry at 60 ms, one stall of 50 ms
    let a = [0.0, 20.0, 40.0, 110.0, 130.0];
    let (e, t) = stalls(&a, &d, 0.0);
    assert_eq!(e, 1);
    assert!((t - 50.0).abs() < 1e-6, "{t}");
    // a 100 ms pre-buffer absorbs it
    assert_eq!(stalls(&a, &d, 100.0), (0, 0.0));
    // a burst arriving all at once never stalls
    assert_eq!(stalls(&[5.0; 5], &d, 0.0), (0, 0.0));
}

#[test]
fn a_reply_has_played_when_its_buffer_runs_dry() {
    let d = vec![20.0; 5];
    // first arrival + audio + stalls: 0 + 100 + 50
    assert_eq!(played_ms(&[0.0, 20.0, 40.0, 110.0, 130.0], &d), Some(150.0));
    // a burst: the audio's length after the first packet
    assert_eq!(played_ms(&[5.0; 5], &d), Some(105.0));
    assert_eq!(played_ms(&[], &[]), None);
}
