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
    }
}
