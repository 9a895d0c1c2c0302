//! The context-fit rule, defined once: what a prompt, its reply and its codes may take of the
//! Thinker's and the Talker's contexts. Every check of a request against a context (the limits a
//! session is told, admission of a prompt, the history that gives way, the Talker's cache) is one
//! of these functions, with the spare positions named here.

/// Positions left free beside a prompt and its longest reply: the reply's closing tokens and the
/// hand-off's markers.
pub const REPLY_SPARE: usize = 8;

/// Positions a history budget keeps aside beyond the reply: the markers of the input's turn and of
/// the reply's opening, which the prompt builder adds around the turns it keeps.
pub const TURN_SPARE: usize = 64;

/// Positions the Thinker's context keeps for the shortest prompt (the system turn and one input)
/// when it tells a session the longest reply it may ask for.
pub const PROMPT_ROOM: usize = 256;

/// Rows the Talker's cache holds beyond a reply's text and codes: the text end and the audio start.
pub const TALKER_MARKERS: usize = 2;

/// The Thinker's context a conversation may take (its prompt, the turns it keeps and a reply):
/// the model's `model` positions, or fewer where the configuration says so (`thinker.context`;
/// 0: the model's). A deployment sets it to its slots' positions so that no conversation outgrows
/// its slot and leaves the batched step: its oldest turns give way within the slot instead.
pub fn conversation_context(model: usize, configured: usize) -> usize {
    if configured == 0 {
        model
    } else {
        configured.min(model)
    }
}

/// Whether a prompt of `prompt` positions and a reply of up to `max_reply` tokens fit `context`.
pub fn prompt_and_reply_fit(prompt: usize, max_reply: usize, context: usize) -> bool {
    prompt
        .checked_add(max_reply)
        .and_then(|n| n.checked_add(REPLY_SPARE))
        .is_some_and(|n| n <= context)
}

/// The positions a prompt's system turn, input and kept history may take beside a reply of up to
/// `max_reply` tokens.
pub fn prompt_budget(context: usize, max_reply: usize) -> usize {
    context.saturating_sub(max_reply.saturating_add(TURN_SPARE))
}

/// The longest text input that always fits beside `fixed` positions (instructions, the voice's
/// rows, the system turn) and a reply of `max_reply` tokens: the history gives way to it.
pub fn max_input(context: usize, fixed: usize, max_reply: usize) -> usize {
    prompt_budget(context, max_reply).saturating_sub(fixed)
}

/// The longest reply a session may ask for: the Thinker's context beside the shortest prompt, and
/// the Talker's beside the reply's markers and at least one code.
pub fn max_reply(thinker_context: usize, talker_context: usize) -> usize {
    thinker_context
        .saturating_sub(PROMPT_ROOM)
        .min(talker_context.saturating_sub(TALKER_MARKERS + 1))
}

/// The most codes a session may ask for: the Talker's context beside a reply of `text` tokens.
pub fn max_codes(talker_context: usize, text: usize) -> usize {
    talker_context.saturating_sub(text.saturating_add(TALKER_MARKERS))
}

/// The rows a Talker cache needs for a reply: its text of up to `text` tokens and its markers then
/// every code; with text chunks of `chunk` tokens, at least two chunks' conditions (a window holds
/// at most that) and every code.
pub fn talker_rows(text: usize, codes: usize, chunk: Option<usize>) -> usize {
    let whole = text.saturating_add(TALKER_MARKERS).saturating_add(codes);
    match chunk {
        Some(c) => whole.max(2 * (c + TALKER_MARKERS) + codes),
        None => whole,
    }
}

/// The positions a prompt's earlier turns may take beside its `fixed` positions (the system turn
/// with its voice, and the input) within `budget` ([`prompt_budget`]): at most half the budget, so
/// a conversation never crowds out a reply, and never more than the fixed part leaves (so an input
/// within [`max_input`] always fits).
pub fn history_room(budget: usize, fixed: usize) -> usize {
    budget.saturating_sub(fixed).min(budget / 2)
}

/// How many of a conversation's oldest turns (their positions `sizes`, oldest first) a prompt
/// leaves out so that the rest take at most `room` positions.
///
/// The cut falls at whole steps of half the room, counted from the first turn given: while the
/// conversation grows by less than a step, the turns left out stay the same, so each prompt starts
/// with the positions of the one before and reuses their KV from the prefix store; only a prompt
/// that moves the cut prefills its kept turns again, once every half room of conversation, not at
/// every turn (the purpose of OpenAI Realtime's `retention_ratio` truncation). After a cut the
/// turns kept take about half the room. A session that drops the turns left out from what it sends
/// next counts from the new first turn: the next cut is again half a room of conversation away.
pub fn oldest_turns_left_out(sizes: &[usize], room: usize) -> usize {
    let total: usize = sizes.iter().sum();
    if total <= room {
        return 0;
    }
    let step = (room / 2).max(1);
    let cut = (total - room).div_ceil(step).saturating_mul(step);
    let mut before = 0;
    for (i, size) in sizes.iter().enumerate() {
        if before >= cut {
            return i;
        }
        before += size;
    }
    sizes.len()
}

/// 16 kHz samples a duplex unit's audio position covers (the Thinker hears 10 a second).
pub const UNIT_SAMPLES_PER_POSITION: usize = 1600;

/// The Thinker's markers around a duplex unit's audio, and around a spoken unit's text.
pub const UNIT_MARKERS: usize = 2;

/// The positions a duplex session's cache holds after its next unit of `unit_samples` and a whole
/// spoken unit of up to `unit_text` tokens after it: the unit's markers and audio, then the text
/// and its markers.
pub fn duplex_rows_after_unit(cache: usize, unit_samples: usize, unit_text: usize) -> usize {
    cache + UNIT_MARKERS + unit_samples / UNIT_SAMPLES_PER_POSITION + unit_text + UNIT_MARKERS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_fits_with_its_spare_positions_and_not_one_more() {
        assert!(prompt_and_reply_fit(1000, 3000 - REPLY_SPARE, 4000));
        assert!(!prompt_and_reply_fit(1001, 3000 - REPLY_SPARE, 4000));
        assert!(!prompt_and_reply_fit(usize::MAX, 1, 4000), "no overflow");
        // an input of the longest length always fits beside its fixed part and the reply
        let (context, fixed, reply) = (4096, 300, 512);
        let input = max_input(context, fixed, reply);
        assert!(prompt_and_reply_fit(fixed + input, reply, context));
        assert_eq!(max_input(100, 300, 512), 0);
        assert_eq!(max_reply(4096, 4096), 4096 - PROMPT_ROOM);
        assert_eq!(max_reply(4096, 100), 100 - TALKER_MARKERS - 1);
        assert_eq!(max_codes(4096, 512), 4096 - 512 - TALKER_MARKERS);
        assert_eq!(talker_rows(512, 100, None), 614);
        assert_eq!(talker_rows(0, 100, Some(10)), 124);
        assert_eq!(duplex_rows_after_unit(500, 16_000, 20), 500 + 2 + 10 + 20 + 2);
        assert_eq!(conversation_context(40960, 0), 40960);
        assert_eq!(conversation_context(40960, 12288), 12288);
        assert_eq!(conversation_context(4096, 12288), 4096);
    }

    #[test]
    fn the_oldest_turns_give_way_in_steps_of_half_the_room() {
        assert_eq!(history_room(8000, 500), 4000);
        assert_eq!(history_room(8000, 5000), 3000);
        assert_eq!(oldest_turns_left_out(&[100; 10], 1000), 0);
        assert_eq!(oldest_turns_left_out(&[100; 10], 0), 10);
        // a conversation growing a turn at a time, sent whole: the turns it keeps fit the room,
        // and the first of them moves once every five turns (half the room), not at every turn
        let (room, size) = (1000, 100);
        let mut firsts = Vec::new();
        for n in 1..=60 {
            let sizes = vec![size; n];
            let first = oldest_turns_left_out(&sizes, room);
            assert!((n - first) * size <= room, "{n} turns keep {}", n - first);
            firsts.push(first);
        }
        assert!(firsts.windows(2).all(|w| w[0] <= w[1]), "{firsts:?}");
        let moves = firsts.windows(2).filter(|w| w[0] != w[1]).count();
        assert_eq!(moves, 10, "{firsts:?}");
        // right after a cut the turns kept take about half the room
        assert_eq!(firsts[10], 5, "{firsts:?}");
        // the same conversation sent by a session that drops the turns left out: after a cut
        // the next turns all fit until half a room more has been said
        let mut held: Vec<usize> = Vec::new();
        let mut cuts = 0;
        for n in 0..60 {
            held.push(size + n % 3);
            let out = oldest_turns_left_out(&held, room);
            assert!(held[out..].iter().sum::<usize>() <= room);
            if out > 0 {
                cuts += 1;
                held.drain(..out);
                assert!(held.iter().sum::<usize>() <= room - room / 2 + 2 * size, "{held:?}");
            }
        }
        assert!((9..=12).contains(&cuts), "{cuts} cuts");
        // turns of any size: what stays always fits
        let sizes = [700, 20, 1500, 3, 300, 900, 40];
        for room in [0, 1, 10, 500, 999, 1600, 3000, 4000] {
            let out = oldest_turns_left_out(&sizes, room);
            assert!(sizes[out..].iter().sum::<usize>() <= room, "room {room}: {out}");
        }
    }
}
