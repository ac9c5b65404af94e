//! Costs read from a response body as it passes (`cost: {response_json}`): a JSON
//! body kept aside up to `JSON_KEPT` and read when it ends, or an event stream
//! read event by event, keeping the last value of each pointer. Pure: bytes in,
//! units out; the body that feeds it and settles the charge is
//! `pipeline::metered`.

use super::response::{BodyCost, CostFrom};

/// The most of a JSON body kept aside to read its cost: a larger one is invalid.
pub const JSON_KEPT: usize = 1 << 20;

/// The longest event of a stream read (its lines as sent): a longer one is skipped,
/// and counted (`Reading::skipped`).
pub const MAX_EVENT: usize = 256 << 10;

/// What a body's cost is read from, by its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `application/json` (or any `+json` type).
    Json,
    /// `text/event-stream`.
    Sse,
    /// Anything else: nothing is read.
    Other,
}

impl Kind {
    pub fn of(content_type: Option<&[u8]>) -> Kind {
        let Some(ct) = content_type else {
            return Kind::Other;
        };
        let essence = ct.split(|&b| b == b';').next().unwrap_or_default();
        let essence = essence.trim_ascii().to_ascii_lowercase();
        if essence == b"text/event-stream" {
            Kind::Sse
        } else if essence == b"application/json"
            || (essence.starts_with(b"application/") && essence.ends_with(b"+json"))
        {
            Kind::Json
        } else {
            Kind::Other
        }
    }
}

/// What the body said at one pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Absent,
    Units(u64),
    /// Something that is not a whole number of units.
    Invalid,
}

/// Reads one body's pointers as it passes.
#[derive(Debug)]
pub struct Reading {
    kind: Kind,
    pointers: Vec<String>,
    /// The last value at each pointer (a stream's), by index in `pointers`.
    found: Vec<Found>,
    /// The JSON body kept so far, or the current line and event of a stream.
    kept: Vec<u8>,
    /// A stream's current event's data (its `data:` lines joined by `\n`).
    data: Vec<u8>,
    /// The JSON body outgrew `JSON_KEPT`, or the current event `MAX_EVENT`.
    over: bool,
    /// Bytes of the current line of a stream (counted when not kept).
    line_bytes: usize,
    /// The last byte was a CR (a CRLF split across chunks is one line end).
    after_cr: bool,
    /// Events skipped as longer than `MAX_EVENT`.
    pub skipped: u64,
}

impl Reading {
    pub fn new(kind: Kind, pointers: Vec<String>) -> Reading {
        Reading {
            kind,
            found: vec![Found::Absent; pointers.len()],
            pointers,
            kept: Vec::new(),
            data: Vec::new(),
            over: false,
            line_bytes: 0,
            after_cr: false,
            skipped: 0,
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The next bytes of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.kind {
            Kind::Other => {}
            Kind::Json => {
                if self.over || self.kept.len() + chunk.len() > JSON_KEPT {
                    self.over = true;
                    self.kept = Vec::new();
                } else {
                    self.kept.extend_from_slice(chunk);
                }
            }
            Kind::Sse => self.feed_stream(chunk),
        }
    }

    fn feed_stream(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            if std::mem::take(&mut self.after_cr) && chunk[0] == b'\n' {
                chunk = &chunk[1..];
                continue;
            }
            match chunk.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(end) => {
                    self.keep(&chunk[..end]);
                    self.after_cr = chunk[end] == b'\r';
                    self.line();
                    chunk = &chunk[end + 1..];
                }
                None => {
                    self.keep(chunk);
                    return;
                }
            }
        }
    }

    /// Part of the current line, unless the event is already too long.
    fn keep(&mut self, part: &[u8]) {
        self.line_bytes += part.len();
        if self.over {
            return;
        }
        if self.kept.len() + self.data.len() + part.len() > MAX_EVENT {
            self.over = true;
            self.kept = Vec::new();
            self.data = Vec::new();
        } else {
            self.kept.extend_from_slice(part);
        }
    }

    /// A whole line of a stream (WHATWG HTML §9.2.6): a blank one ends the event.
    fn line(&mut self) {
        let blank = std::mem::take(&mut self.line_bytes) == 0;
        if self.over {
            if blank {
                // The blank line that ends the skipped event.
                self.over = false;
                self.skipped += 1;
            }
            self.kept.clear();
            return;
        }
        let line = std::mem::take(&mut self.kept);
        if line.is_empty() {
            self.dispatch();
        } else if let Some(value) = field_value(&line, b"data") {
            if !self.data.is_empty() {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
        }
        // Other fields (event, id, retry) and comments say nothing of the cost.
        self.kept = line;
        self.kept.clear();
    }

    /// An event's data: when JSON, the values at the pointers replace the last.
    fn dispatch(&mut self) {
        let data = std::mem::take(&mut self.data);
        if let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&data) {
            for (p, found) in self.pointers.iter().zip(&mut self.found) {
                match at(&doc, p) {
                    Found::Absent => {}
                    f => *found = f,
                }
            }
        }
        self.data = data;
        self.data.clear();
    }

    /// What the body said at each pointer, once it has ended or been cut short. A
    /// JSON body that is not one document (or was larger than `JSON_KEPT`) says
    /// `Invalid` everywhere; an unfinished event of a stream is not read.
    pub fn finish(&mut self) -> &[Found] {
        if self.kind == Kind::Json {
            let doc = (!self.over)
                .then(|| serde_json::from_slice::<serde_json::Value>(&self.kept).ok())
                .flatten();
            for (p, found) in self.pointers.iter().zip(&mut self.found) {
                *found = doc.as_ref().map_or(Found::Invalid, |d| at(d, p));
            }
            self.kept = Vec::new();
        }
        &self.found
    }

    /// The charge of a limit whose pointers are `which` (indices into the
    /// pointers), once `finish`ed: the sum of what was found (at most `cost.cap`),
    /// else, when the body was cut short (`cut`: the client went away, the
    /// upstream failed), the `held` estimate or `default`; else, when what it said
    /// is not a cost, the estimate or `default` (`Invalid`); else `default`.
    pub fn charge(
        &self,
        which: &[usize],
        cost: &BodyCost,
        held: Option<u64>,
        cut: bool,
    ) -> Charged {
        let found = which.iter().filter_map(|&i| self.found.get(i));
        let mut sum: Option<u64> = None;
        let mut invalid = self.kind == Kind::Json && self.over;
        for f in found {
            match f {
                Found::Units(n) => sum = Some(sum.unwrap_or(0).saturating_add(*n)),
                Found::Invalid => invalid = true,
                Found::Absent => {}
            }
        }
        if let Some(n) = sum {
            let from = match self.kind {
                _ if n > cost.cap => return (cost.cap, CostFrom::Capped),
                Kind::Sse => CostFrom::Sse,
                _ => CostFrom::Json,
            };
            return (n, from);
        }
        match (cut, invalid, held) {
            (true, _, Some(h)) => (h, CostFrom::Estimate),
            (true, _, None) | (false, false, _) => (cost.default, CostFrom::Default),
            (false, true, h) => (h.unwrap_or(cost.default), CostFrom::Invalid),
        }
    }
}

/// Units charged, and where they came from.
pub type Charged = (u64, CostFrom);

/// The value of the field `name` of a stream's line, its one leading space
/// dropped; a line of the name alone has an empty value.
fn field_value<'l>(line: &'l [u8], name: &[u8]) -> Option<&'l [u8]> {
    let rest = line.strip_prefix(name)?;
    match rest.split_first() {
        None => Some(rest),
        Some((b':', v)) => Some(v.strip_prefix(b" ").unwrap_or(v)),
        Some(_) => None,
    }
}

/// What `doc` has at `pointer` (RFC 6901).
fn at(doc: &serde_json::Value, pointer: &str) -> Found {
    match doc.pointer(pointer) {
        None | Some(serde_json::Value::Null) => Found::Absent,
        Some(v) => v.as_u64().map_or(Found::Invalid, Found::Units),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cost(n: usize) -> BodyCost {
        BodyCost {
            pointers: vec![String::new(); n],
            estimate: None,
            default: 7,
            cap: 100_000,
        }
    }

    fn read(
        kind: Kind,
        pointers: &[&str],
        chunks: &[&[u8]],
        cut: bool,
        held: Option<u64>,
    ) -> (Charged, u64) {
        let mut r = Reading::new(kind, pointers.iter().map(|p| p.to_string()).collect());
        for c in chunks {
            r.feed(c);
        }
        r.finish();
        let which: Vec<usize> = (0..pointers.len()).collect();
        (
            r.charge(&which, &cost(pointers.len()), held, cut),
            r.skipped,
        )
    }

    const OPENAI_STREAM: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\n\
data: [DONE]\n\n";

    const ANTHROPIC_STREAM: &[u8] = b"event: message_start\r\n\
data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\n\
event: ping\r\ndata: {\"type\": \"ping\"}\r\n\r\n\
: a comment\r\n\
event: message_delta\r\n\
data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\r\n\r\n\
event: message_delta\r\n\
data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":42}}\r\n\r\n\
event: message_stop\r\ndata: {\"type\":\"message_stop\"}\r\n\r\n";

    const ANTHROPIC: [&str; 2] = ["/message/usage/input_tokens", "/usage/output_tokens"];

    #[test]
    fn content_types_say_what_is_read() {
        let cases: [(Option<&[u8]>, Kind); 7] = [
            (Some(b"application/json"), Kind::Json),
            (Some(b"Application/JSON; charset=utf-8"), Kind::Json),
            (Some(b"application/problem+json"), Kind::Json),
            (Some(b"text/event-stream"), Kind::Sse),
            (Some(b" text/event-stream ;charset=utf-8"), Kind::Sse),
            (Some(b"text/plain"), Kind::Other),
            (None, Kind::Other),
        ];
        for (ct, kind) in cases {
            assert_eq!(Kind::of(ct), kind, "{ct:?}");
        }
    }

    #[test]
    fn a_json_body_is_read_at_its_pointers_when_it_ends() {
        let body: &[u8] =
            br#"{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":32,"total_tokens":42}}"#;
        let json = |pointers: &[&str], chunks: &[&[u8]], cut| {
            read(Kind::Json, pointers, chunks, cut, None).0
        };
        assert_eq!(
            json(&["/usage/total_tokens"], &[body], false),
            (42, CostFrom::Json)
        );
        let (a, b) = body.split_at(20);
        assert_eq!(
            json(&["/usage/total_tokens"], &[a, b], false),
            (42, CostFrom::Json)
        );
        assert_eq!(
            json(
                &["/usage/prompt_tokens", "/usage/completion_tokens"],
                &[body],
                false
            ),
            (42, CostFrom::Json)
        );
        // One pointer found is enough: the other counts nothing.
        assert_eq!(
            json(&["/usage/total_tokens", "/nope"], &[body], false),
            (42, CostFrom::Json)
        );
        assert_eq!(json(&["/nope"], &[body], false), (7, CostFrom::Default));
        assert_eq!(json(&["/id"], &[body], false), (7, CostFrom::Invalid));
        assert_eq!(
            json(&["/usage/total_tokens"], &[b"{\"usage\":"], false),
            (7, CostFrom::Invalid)
        );
        assert_eq!(
            json(
                &["/usage/total_tokens"],
                &[br#"{"usage":{"total_tokens":-3}}"#],
                false
            ),
            (7, CostFrom::Invalid)
        );
        assert_eq!(
            json(
                &["/usage/total_tokens"],
                &[br#"{"usage":{"total_tokens":2.5}}"#],
                false
            ),
            (7, CostFrom::Invalid)
        );
        assert_eq!(
            json(
                &["/usage/total_tokens"],
                &[br#"{"usage":{"total_tokens":999999}}"#],
                false
            ),
            (100_000, CostFrom::Capped)
        );
        // Larger than what is kept: invalid, whatever it says.
        let mut big = br#"{"pad":""#.to_vec();
        big.resize(JSON_KEPT, b'a');
        big.extend_from_slice(br#"","usage":{"total_tokens":5}}"#);
        assert_eq!(
            json(&["/usage/total_tokens"], &[&big], false),
            (7, CostFrom::Invalid)
        );
        // With an estimate held: kept when the body is invalid or cut short.
        let held = |chunks: &[&[u8]], cut| {
            read(Kind::Json, &["/usage/total_tokens"], chunks, cut, Some(300)).0
        };
        assert_eq!(held(&[body], false), (42, CostFrom::Json));
        assert_eq!(held(&[a], true), (300, CostFrom::Estimate));
        assert_eq!(held(&[b"{"], false), (300, CostFrom::Invalid));
        assert_eq!(
            held(&[br#"{"error":"overloaded"}"#], false),
            (7, CostFrom::Default)
        );
        assert_eq!(held(&[], true), (300, CostFrom::Estimate));
        // Cut short without an estimate: the default.
        assert_eq!(
            json(&["/usage/total_tokens"], &[a], true),
            (7, CostFrom::Default)
        );
    }

    #[test]
    fn an_openai_stream_is_charged_its_last_usage() {
        let (charged, skipped) = read(
            Kind::Sse,
            &["/usage/total_tokens"],
            &[OPENAI_STREAM],
            false,
            None,
        );
        assert_eq!((charged, skipped), ((21, CostFrom::Sse), 0));
        // A stream without usage (no `include_usage`): the default.
        let (charged, _) = read(
            Kind::Sse,
            &["/usage/total_tokens"],
            &[&OPENAI_STREAM[..70]],
            false,
            None,
        );
        assert_eq!(charged, (7, CostFrom::Default));
        // Cut short before the usage, an estimate held: the estimate.
        let (charged, _) = read(
            Kind::Sse,
            &["/usage/total_tokens"],
            &[&OPENAI_STREAM[..70]],
            true,
            Some(50),
        );
        assert_eq!(charged, (50, CostFrom::Estimate));
    }

    #[test]
    fn an_anthropic_stream_sums_input_and_the_last_output() {
        let (charged, _) = read(Kind::Sse, &ANTHROPIC, &[ANTHROPIC_STREAM], false, None);
        assert_eq!(charged, (25 + 42, CostFrom::Sse));
        // Gone after the first delta: what was seen.
        let first_delta = ANTHROPIC_STREAM
            .windows(4)
            .position(|w| w == b"15}}")
            .unwrap();
        let (charged, _) = read(
            Kind::Sse,
            &ANTHROPIC,
            &[&ANTHROPIC_STREAM[..first_delta + 10]],
            true,
            Some(1000),
        );
        assert_eq!(charged, (25 + 15, CostFrom::Sse));
    }

    #[test]
    fn data_lines_join_and_other_fields_are_ignored() {
        let stream: &[u8] = b"id: 1\nretry: 10\ndata: {\"usage\":\ndata: {\"n\": 3}}\n\ndata:{\"usage\":{\"n\":4}}\r\rdata\n\n";
        let (charged, _) = read(Kind::Sse, &["/usage/n"], &[stream], false, None);
        assert_eq!(charged, (4, CostFrom::Sse));
        // An event not ended by a blank line is not read.
        let (charged, _) = read(
            Kind::Sse,
            &["/usage/n"],
            &[b"data: {\"usage\":{\"n\":4}}\n"],
            true,
            None,
        );
        assert_eq!(charged, (7, CostFrom::Default));
    }

    #[test]
    fn an_event_longer_than_the_bound_is_skipped_and_counted() {
        let mut stream = b"data: {\"usage\":{\"n\":3}}\n\ndata: {\"pad\":\"".to_vec();
        stream.resize(stream.len() + MAX_EVENT, b'x');
        stream.extend_from_slice(b"\",\"usage\":{\"n\":1000}}\n\n");
        stream.extend_from_slice(b"data: not json\n\n");
        let (charged, skipped) = read(Kind::Sse, &["/usage/n"], &[&stream], false, None);
        assert_eq!((charged, skipped), ((3, CostFrom::Sse), 1));
        stream.extend_from_slice(b"data: {\"usage\":{\"n\":5}}\n\n");
        let (charged, skipped) = read(Kind::Sse, &["/usage/n"], &[&stream], false, None);
        assert_eq!((charged, skipped), ((5, CostFrom::Sse), 1));
    }

    #[test]
    fn another_type_reads_nothing() {
        let (charged, _) = read(
            Kind::Other,
            &["/usage/n"],
            &[b"{\"usage\":{\"n\":4}}"],
            false,
            Some(9),
        );
        assert_eq!(charged, (7, CostFrom::Default));
    }

    /// A stream read in pieces: split at `cuts` (positions, any order).
    fn in_pieces(stream: &[u8], pointers: &[&str], cuts: &[usize]) -> (Charged, u64) {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
        at.sort_unstable();
        let mut chunks: Vec<&[u8]> = Vec::new();
        let mut from = 0;
        for c in at {
            chunks.push(&stream[from..c]);
            from = c;
        }
        chunks.push(&stream[from..]);
        read(Kind::Sse, pointers, &chunks, false, None)
    }

    proptest! {
        #[test]
        fn any_split_of_a_stream_reads_the_same(cuts in proptest::collection::vec(0usize..4096, 0..40)) {
            let mut long = b"data: {\"pad\":\"".to_vec();
            long.resize(MAX_EVENT + 10, b'y');
            long.extend_from_slice(b"\"}\n\n");
            for (stream, pointers) in [
                (OPENAI_STREAM.to_vec(), &["/usage/total_tokens"][..]),
                (ANTHROPIC_STREAM.to_vec(), &ANTHROPIC[..]),
                ([ANTHROPIC_STREAM, &long, OPENAI_STREAM].concat(), &["/usage/total_tokens", "/usage/output_tokens"][..]),
            ] {
                let whole = in_pieces(&stream, pointers, &[]);
                let scaled: Vec<usize> = cuts.iter().map(|c| c * stream.len() / 4096).collect();
                prop_assert_eq!(in_pieces(&stream, pointers, &scaled), whole);
            }
        }
    }
}
