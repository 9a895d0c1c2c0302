//! The stages' inboxes as the async side (the server's session tasks) sees them: bounded
//! (`EngineConfig::channel_capacity` messages each, 1024), and offered to without waiting, so
//! a stage that falls behind never blocks a tokio worker. Admission bounds what the server can
//! have in flight (streams running and queued, duplex sessions): a full inbox means a stuck stage.
//!
//! A full inbox means a stage thread is a whole inbox of messages behind. The caller of the
//! engine's API is told and decides: a response is refused as at capacity, a duplex unit is handed
//! back to be offered again, a voice's preparation is refused. A cancel or a duplex close that
//! finds the inbox full is not lost: the registry (a request's life) and admission (a duplex
//! session's place) are the authority, the message only wakes the stage, and a stage whose inbox
//! holds messages steps, and its step sweeps away what is no longer live.

use std::sync::mpsc::{SyncSender, TrySendError};

/// What became of a message offered to a stage.
#[derive(Debug)]
pub(crate) enum Offer<M> {
    Taken,
    /// The inbox is full: the message comes back.
    Full(M),
    /// The stage has stopped.
    Stopped,
}

impl<M> Offer<M> {
    /// Taken, or why not (for the callers that answer with an error; `stage` names the inbox).
    pub(crate) fn or_refused(self, stage: &str) -> anyhow::Result<()> {
        match self {
            Offer::Taken => Ok(()),
            Offer::Full(_) => {
                anyhow::bail!("the engine is behind ({stage}'s inbox is full); try again")
            }
            Offer::Stopped => anyhow::bail!("the engine has stopped"),
        }
    }
}

/// Offers `m` to a stage without waiting for room.
pub(crate) fn offer<M>(to: Option<&SyncSender<M>>, m: M) -> Offer<M> {
    let Some(to) = to else { return Offer::Stopped };
    match to.try_send(m) {
        Ok(()) => Offer::Taken,
        Err(TrySendError::Full(m)) => Offer::Full(m),
        Err(TrySendError::Disconnected(_)) => Offer::Stopped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_inbox_hands_the_message_back_without_waiting() {
        let (tx, rx) = std::sync::mpsc::sync_channel::<u32>(1);
        assert!(matches!(offer(Some(&tx), 1), Offer::Taken));
        match offer(Some(&tx), 2) {
            Offer::Full(m) => assert_eq!(m, 2),
            other => panic!("a full inbox took the message: {other:?}"),
        }
        assert_eq!(rx.recv().unwrap(), 1);
        assert!(matches!(offer(Some(&tx), 3), Offer::Taken), "room again once the stage took one");
        drop(rx);
        assert!(matches!(offer(Some(&tx), 4), Offer::Stopped));
        assert!(matches!(offer::<u32>(None, 5), Offer::Stopped));
    }
}
