//! The server's own view of a level: `/metrics` scraped before and after it, reduced to the
//! per-stage step times, batch sizes and first-audio milestones of that level alone (deltas of the
//! histograms' sums and counts).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Means over one level, from the server's histograms.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ServerBreakdown {
    /// Mean duration of one batched step, per stage (ms).
    pub step_ms: BTreeMap<String, f64>,
    /// Steps taken, per stage.
    pub steps: BTreeMap<String, f64>,
    /// Mean streams per step, per stage.
    pub batch_mean: BTreeMap<String, f64>,
    /// Mean time from admission to each milestone of a request (ms): first_token, first_text,
    /// handoff, first_code, chunk0_codes, first_chunk, first_audio.
    pub phase_ms: BTreeMap<String, f64>,
}

/// `(metric, label value) -> (sum, count)` of every histogram with one label.
pub type Sums = BTreeMap<(String, String), (f64, f64)>;

/// GET `path` on the HTTP server behind a `ws://host:port/...` URL; the body, if 200.
pub async fn http_get(ws_url: &str, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = ws_url.strip_prefix("ws://")?;
    let host = rest.split('/').next()?;
    let mut s = tokio::net::TcpStream::connect(host).await.ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return None;
    }
    // the metrics endpoint may answer chunked; the text format has no lines that look like sizes
    // followed by a blank, so undo the framing when the header says so
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Some(dechunk(body));
    }
    Some(body.to_string())
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Reads `name_sum{label="v"} x` and `name_count{label="v"} y` lines of the text format.
pub fn parse(text: &str) -> Sums {
    let mut out = Sums::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((key, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        let (name, label) = match key.split_once('{') {
            Some((n, rest)) => (
                n,
                rest.split_once("=\"")
                    .and_then(|(_, v)| v.split_once('"'))
                    .map(|(v, _)| v)
                    .unwrap_or(""),
            ),
            None => (key, ""),
        };
        if let Some(metric) = name.strip_suffix("_sum") {
            out.entry((metric.to_string(), label.to_string())).or_default().0 = value;
        } else if let Some(metric) = name.strip_suffix("_count") {
            out.entry((metric.to_string(), label.to_string())).or_default().1 = value;
        }
    }
    out
}

/// What happened between two scrapes.
pub fn breakdown(before: &Sums, after: &Sums) -> ServerBreakdown {
    let mut b = ServerBreakdown::default();
    for ((metric, label), &(sum, count)) in after {
        let (s0, c0) = before.get(&(metric.clone(), label.clone())).copied().unwrap_or_default();
        let (ds, dc) = (sum - s0, count - c0);
        if dc <= 0.0 {
            continue;
        }
        let mean = ds / dc;
        match metric.as_str() {
            "antiphon_stage_step_seconds" => {
                b.step_ms.insert(label.clone(), mean * 1000.0);
                b.steps.insert(label.clone(), dc);
            }
            "antiphon_stage_batch_size" => {
                b.batch_mean.insert(label.clone(), mean);
            }
            "antiphon_engine_phase_seconds" => {
                b.phase_ms.insert(label.clone(), mean * 1000.0);
            }
            _ => {}
        }
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "# HELP x\nantiphon_stage_step_seconds_bucket{stage=\"thinker\",le=\"0.01\"} \
    3\n\
    antiphon_stage_step_seconds_sum{stage=\"thinker\"} \
    0.5\nantiphon_stage_step_seconds_count{stage=\"thinker\"} 10\n\
    antiphon_engine_phase_seconds_sum{phase=\"first_audio\"} \
    1\nantiphon_engine_phase_seconds_count{phase=\"first_audio\"} 2\n";
    const B: &str = "antiphon_stage_step_seconds_sum{stage=\"thinker\"} \
    1.5\nantiphon_stage_step_seconds_count{stage=\"thinker\"} 30\n\
    antiphon_stage_batch_size_sum{stage=\"thinker\"} \
    40\nantiphon_stage_batch_size_count{stage=\"thinker\"} 20\n\
    antiphon_engine_phase_seconds_sum{phase=\"first_audio\"} \
    1.6\nantiphon_engine_phase_seconds_count{phase=\"first_audio\"} 4\n";

    #[test]
    fn level_deltas() {
        let b = breakdown(&parse(A), &parse(B));
        assert!((b.step_ms["thinker"] - 50.0).abs() < 1e-9, "{b:?}");
        assert_eq!(b.steps["thinker"], 20.0);
        assert!((b.batch_mean["thinker"] - 2.0).abs() < 1e-9);
        assert!((b.phase_ms["first_audio"] - 300.0).abs() < 1e-9);
        assert!(breakdown(&parse(B), &parse(B)).step_ms.is_empty());
    }

    #[test]
    fn chunked_bodies() {
        assert_eq!(dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), "hello world");
    }
}
