//! The playback model the bench scores a response by: a client that starts playing on the first
//! packet (plus a pre-buffer) and pauses whenever its buffer runs dry.

/// The playback model: playback starts when the first packet arrives plus `prebuffer`, consumes
/// in real time, and pauses whenever the buffer is empty before the response's last packet (one
/// stall per pause). Returns (events, total ms).
pub fn stalls(arrivals_ms: &[f64], durations_ms: &[f64], prebuffer_ms: f64) -> (usize, f64) {
    let (events, total, _) = playback(arrivals_ms, durations_ms, prebuffer_ms);
    (events, total)
}

/// When playback of a response ends under the playback model with no pre-buffer (the moment its
/// buffer runs dry after the last packet: first arrival + audio + stalls), in the arrivals' time.
pub fn played_ms(arrivals_ms: &[f64], durations_ms: &[f64]) -> Option<f64> {
    (!arrivals_ms.is_empty()).then(|| playback(arrivals_ms, durations_ms, 0.0).2)
}

/// The playback model: (stall events, stall ms, the moment the buffer runs dry at the end).
fn playback(arrivals_ms: &[f64], durations_ms: &[f64], prebuffer_ms: f64) -> (usize, f64, f64) {
    let Some(&first) = arrivals_ms.first() else {
        return (0, 0.0, 0.0);
    };
    // the moment the buffer runs dry if nothing more arrives
    let mut dry = first + prebuffer_ms;
    let mut events = 0;
    let mut total = 0.0;
    for (i, (&a, &d)) in arrivals_ms.iter().zip(durations_ms).enumerate() {
        if i > 0 && a > dry + 1e-9 {
            events += 1;
            total += a - dry;
            dry = a;
        }
        dry += d;
    }
    (events, total, dry)
}
