//! Chaos (issue 17): one session through many responses while its socket is cut without a close
//! frame at random moments — mid-response, right after a resume while the journal replays, before
//! the server has seen the input — and resumed each time as the protocol says (resume with the
//! highest seq held, resend the input after `input_seq`). Every server message must arrive exactly
//! once and in order (the seqs are 1..=n), and every request gets exactly one `response.done`.

// (shared with tests/integration/server.rs, which uses all of it)
#[allow(dead_code)]
use crate::wire;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use wire::{server, short, Client, In};

struct Session {
    id: String,
    token: String,
    /// Server seqs seen, in arrival order.
    seen: Vec<u64>,
    /// Inputs sent (client seq, event), to resend after a resume.
    inputs: Vec<(u64, Value)>,
    done: usize,
    drops: usize,
}

impl Session {
    fn take(&mut self, m: &In) {
        if let Some(q) = m.seq() {
            self.seen.push(q);
        }
        if m.ty() == "response.done" {
            self.done += 1;
        }
    }

    /// Resumes on a new socket; resends the inputs the server had not applied.
    async fn resume(&mut self, s: &antiphon_server::Server) -> Client {
        let mut c = Client::connect(s).await;
        let last = self.seen.iter().copied().max().unwrap_or(0);
        c.send(json!({"type": "session.resume", "session_id": self.id, "resume_token": self.token,
            "last_seq": last}))
            .await;
        let resumed = c.event("session.resumed").await;
        let applied = resumed["input_seq"].as_u64().expect("input_seq");
        for (q, v) in &self.inputs {
            if *q > applied {
                c.send(v.clone()).await;
            }
        }
        self.drops += 1;
        c
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_drops_across_many_responses_lose_and_double_nothing() {
    let s = server(|_| {}).await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2026);
    let mut c = Client::connect(&s).await;
    let created = c.create(json!({})).await;
    let mut sess = Session {
        id: created["session_id"].as_str().unwrap().into(),
        token: created["resume_token"].as_str().unwrap().into(),
        seen: vec![created["seq"].as_u64().unwrap()],
        inputs: vec![],
        done: 0,
        drops: 0,
    };
    let responses = 8;
    for k in 1..=responses {
        let ev = json!({"type": "input.text", "text": format!("turn {k}"), "seq": k,
            "generation": short(30)});
        sess.inputs.push((k, ev.clone()));
        c.send(ev).await;
        // sometimes cut at once, before the server may have seen the input
        if rng.random_bool(0.25) {
            drop(c);
            c = sess.resume(&s).await;
        }
        // then read, cutting after a random number of messages, up to three times a response
        let mut cuts = rng.random_range(0..=3);
        loop {
            let budget = if cuts > 0 { rng.random_range(0..25) } else { usize::MAX };
            let mut n = 0;
            let mut finished = false;
            while n < budget {
                let m = c.recv().await;
                assert!(!matches!(m, In::Closed(_)), "the server closed the socket: {m:?}");
                sess.take(&m);
                n += 1;
                if sess.done == k as usize {
                    finished = true;
                    break;
                }
            }
            if finished {
                break;
            }
            cuts -= 1;
            drop(c); // unclean: no close frame
            c = sess.resume(&s).await;
        }
    }
    // acknowledge everything, then a clean close
    let last = *sess.seen.iter().max().unwrap();
    c.send(json!({"type": "ack", "seq": last})).await;
    c.send(json!({"type": "session.close"})).await;
    let n = sess.seen.len() as u64;
    assert_eq!(
        sess.seen,
        (1..=n).collect::<Vec<_>>(),
        "every message once, in order ({} drops)",
        sess.drops
    );
    assert_eq!(sess.done, responses as usize, "one response.done per request");
    assert!(sess.drops >= 8, "the schedule cut the socket only {} times", sess.drops);
    s.shutdown().await.unwrap();
}
