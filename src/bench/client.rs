//! The bench's protocol client: one WebSocket, its sequence numbers and acks, a turn-mode
//! `session.create`, `session.close`; the server's `capacity` refusal as an error of its own.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use super::BenchConfig;

pub(crate) type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub(crate) struct Client {
    pub(crate) ws: Ws,
    pub(crate) last_seq: u64,
    pub(crate) input_seq: u64,
    pub(crate) frame_ms: f64,
}

pub(crate) enum Msg {
    Event(Value),
    Audio,
}

impl Client {
    /// A new connection. An upgrade the server answers `503` (too many connections) is a
    /// [`Capacity`] refusal, its `Retry-After` (seconds) kept.
    pub(crate) async fn connect(cfg: &BenchConfig) -> Result<Self> {
        Self::connect_to(&cfg.url, cfg.api_key.as_deref()).await
    }

    async fn connect_to(url: &str, api_key: Option<&str>) -> Result<Self> {
        use tokio_tungstenite::tungstenite::Error;
        let mut req = url.into_client_request()?;
        if let Some(k) = api_key {
            req.headers_mut().insert("authorization", format!("Bearer {k}").parse()?);
        }
        // Nagle's algorithm off, as browsers have it for a WebSocket: with it on, an `input.text`
        // written right after an `ack` waits for the server's delayed ACK (up to 40 ms), which the
        // measured first audio would include
        let ws = match tokio_tungstenite::connect_async_with_config(req, None, true).await {
            Ok((ws, _)) => ws,
            Err(Error::Http(r)) if r.status().as_u16() == 503 => {
                let after = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
                return Err(anyhow::Error::new(Capacity(after.map(|s| s * 1000))));
            }
            Err(e) => return Err(e).with_context(|| format!("connecting to {url}")),
        };
        Ok(Self { ws, last_seq: 0, input_seq: 0, frame_ms: 20.0 })
    }

    pub(crate) async fn send(&mut self, mut v: Value) -> Result<()> {
        if v["type"] != "ack" {
            self.input_seq += 1;
            v["seq"] = json!(self.input_seq);
        }
        self.ws.send(Message::Text(v.to_string().into())).await?;
        Ok(())
    }

    pub(crate) async fn recv(&mut self, timeout: Duration) -> Result<Msg> {
        loop {
            let m = tokio::time::timeout(timeout, self.ws.next())
                .await
                .map_err(|_| anyhow!("timed out waiting for the server"))?;
            match m {
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(&t)?;
                    if let Some(s) = v.get("seq").and_then(Value::as_u64) {
                        self.last_seq = self.last_seq.max(s);
                    }
                    return Ok(Msg::Event(v));
                }
                Some(Ok(Message::Binary(b))) => {
                    if b.len() < 12 {
                        bail!("a binary frame shorter than its header");
                    }
                    let seq = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as u64;
                    self.last_seq = self.last_seq.max(seq);
                    if b[0] != 1 {
                        continue;
                    }
                    return Ok(Msg::Audio);
                }
                Some(Ok(Message::Close(c))) => bail!("closed by the server: {c:?}"),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.into()),
                None => bail!("the connection ended"),
            }
        }
    }

    pub(crate) async fn ack(&mut self) -> Result<()> {
        let s = self.last_seq;
        self.ws.send(Message::Text(json!({"type": "ack", "seq": s}).to_string().into())).await?;
        Ok(())
    }

    /// `session.create` in turn mode; a `capacity` answer is a [`Capacity`] error.
    pub(crate) async fn create(&mut self, cfg: &BenchConfig) -> Result<Value> {
        self.send(json!({"type": "session.create", "mode": "turn",
            "input_audio": {"codec": "opus", "sample_rate": 48000},
            "output_audio": {"codec": "opus", "frame_ms": 20},
                "input_transcription": cfg.transcribe}))
            .await?;
        loop {
            match self.recv(cfg.timeout).await? {
                Msg::Event(v) if v["type"] == "session.created" => {
                    self.frame_ms = v["output_audio"]["frame_ms"].as_f64().unwrap_or(20.0);
                    return Ok(v);
                }
                Msg::Event(v) if v["type"] == "error" => {
                    if v["code"] == "capacity" {
                        return Err(anyhow::Error::new(Capacity(v["retry_after_ms"].as_u64())));
                    }
                    bail!("session.create: {} ({})", v["code"], v["message"])
                }
                _ => {}
            }
        }
    }

    /// Ends the session (`session.close`) and waits (up to 5 s) for the server to close the
    /// connection, so that its place is free before the caller opens another.
    pub(crate) async fn close(&mut self) {
        let _ = self.send(json!({"type": "session.close"})).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(Ok(_)) = self.ws.next().await {}
        })
        .await;
    }

    /// A new connection with a turn-mode session. A server with no free session (`capacity`) is
    /// asked again after its `retry_after_ms`, for up to the bench's timeout: sessions that
    /// earlier clients left parked free their places as they expire.
    pub(crate) async fn open(cfg: &BenchConfig) -> Result<Self> {
        let t0 = Instant::now();
        loop {
            let attempt = async {
                let mut c = Self::connect(cfg).await?;
                c.create(cfg).await?;
                Ok::<_, anyhow::Error>(c)
            };
            match attempt.await {
                Ok(c) => return Ok(c),
                Err(e) => match e.downcast_ref::<Capacity>() {
                    Some(Capacity(ms)) if t0.elapsed() < cfg.timeout => {
                        tokio::time::sleep(Duration::from_millis(
                            ms.unwrap_or(1000).clamp(50, 5000),
                        ))
                        .await;
                    }
                    _ => return Err(e),
                },
            }
        }
    }
}

/// The server had no free session (or connection); it asked to retry after this many ms, if it
/// said.
#[derive(Debug)]
pub(crate) struct Capacity(pub(crate) Option<u64>);

impl std::fmt::Display for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(ms) => write!(
                f,
                "session.create: \"capacity\" (the server has no free session; \
                retry after {ms} ms)"
            ),
            None => write!(f, "session.create: \"capacity\" (the server has no free session)"),
        }
    }
}

impl std::error::Error for Capacity {}

#[cfg(test)]
mod tests {
    use tokio_tungstenite::MaybeTlsStream;

    /// The client's socket has Nagle's algorithm off (as a browser's WebSocket has), so no
    /// message it writes waits for the server's delayed ACK.
    #[tokio::test]
    async fn the_client_socket_has_nagle_off() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}/", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            tokio_tungstenite::accept_async(tcp).await.unwrap()
        });
        let c = super::Client::connect_to(&url, None).await.unwrap();
        let _server_side = server.await.unwrap();
        match c.ws.get_ref() {
            MaybeTlsStream::Plain(tcp) => assert!(tcp.nodelay().unwrap(), "Nagle is on"),
            _ => panic!("a plain TCP socket expected"),
        }
    }
}
