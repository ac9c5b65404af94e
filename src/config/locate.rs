//! Where each node of a YAML file sits. serde_yaml locates its own errors, but the
//! semantic checks in `validate` run on the deserialized structs and need positions
//! too: this index maps a path like `routes[2].limits[0].window` to the 1-based line
//! and column of the node (and of its mapping key), read with yaml-rust2's parser.

use std::collections::HashMap;

use yaml_rust2::parser::{MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};
use yaml_rust2::Event;

/// A 1-based (line, column) in the file.
pub type Pos = (usize, usize);

/// Path of the child `name` of the mapping at `parent`: `parent.name`, or
/// `parent["name"]` when the name contains characters that would make the path
/// ambiguous (`.`, `[`, `]`, `"`, `\`, or nothing at all).
pub fn field(parent: &str, name: &str) -> String {
    let plain = !name.is_empty() && !name.contains(['.', '[', ']', '"', '\\']);
    match (parent.is_empty(), plain) {
        (true, true) => name.to_string(),
        (false, true) => format!("{parent}.{name}"),
        (_, false) => {
            let escaped = name.replace('\\', "\\\\").replace('"', "\\\"");
            format!("{parent}[\"{escaped}\"]")
        }
    }
}

/// Path of the `i`th item of the sequence at `parent`: `parent[i]`.
pub fn item(parent: &str, i: usize) -> String {
    format!("{parent}[{i}]")
}

/// The path one level up: `routes[1].match` → `routes[1]` → `routes` → `` (the
/// document). `None` for the document itself.
pub fn parent(path: &str) -> Option<&str> {
    if path.is_empty() {
        return None;
    }
    let b = path.as_bytes();
    let mut i = 0;
    let mut last = 0;
    while i < b.len() {
        last = i;
        if b[i] == b'[' && b.get(i + 1) == Some(&b'"') {
            // A quoted name: skip to its closing `"]`, honouring `\` escapes.
            i += 2;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 2;
        } else if b[i] == b'[' {
            while i < b.len() && b[i] != b']' {
                i += 1;
            }
            i += 1;
        } else {
            // A plain name, with its leading `.` unless it starts the path.
            i += 1;
            while i < b.len() && b[i] != b'.' && b[i] != b'[' {
                i += 1;
            }
        }
    }
    Some(&path[..last.min(path.len())])
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    node: Pos,
    key: Option<Pos>,
}

/// Positions of the nodes of one YAML document, by path. The document itself has
/// the path `""`.
#[derive(Debug, Clone, Default)]
pub struct Index {
    entries: HashMap<String, Entry>,
}

impl Index {
    /// Index the first document of `text`. Never fails: on a syntax error the
    /// index holds what was read before it (serde_yaml reports the error itself).
    pub fn parse(text: &str) -> Index {
        // yaml-rust2 stops at a byte order mark; libyaml (serde_yaml) skips it
        // without counting a column, and so do we.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut builder = Builder::default();
        let mut parser = Parser::new_from_str(text);
        // An error only cuts the index short; the nodes read so far are still right.
        let _ = parser.load(&mut builder, false);
        Index {
            entries: builder.entries,
        }
    }

    /// Position of the node at `path`, if the file has it.
    pub fn at(&self, path: &str) -> Option<Pos> {
        self.entries.get(path).map(|e| e.node)
    }

    /// Position of the mapping key that names the node at `path` (the `max_delay`
    /// in `max_delay: 2s`); `None` for sequence items, the document, or a path the
    /// file does not have.
    pub fn key_at(&self, path: &str) -> Option<Pos> {
        self.entries.get(path).and_then(|e| e.key)
    }

    /// Position of the node at `path`, or of its nearest ancestor the file has (a
    /// missing field is reported at the mapping that lacks it); line 1, column 1
    /// when the file has none of them.
    pub fn nearest(&self, path: &str) -> Pos {
        let mut p = Some(path);
        while let Some(cur) = p {
            if let Some(pos) = self.at(cur) {
                return pos;
            }
            p = parent(cur);
        }
        (1, 1)
    }

    /// Position of the key that names `path` (for errors about a field's name or
    /// presence), else as `nearest`.
    pub fn nearest_key(&self, path: &str) -> Pos {
        self.key_at(path).unwrap_or_else(|| self.nearest(path))
    }

    /// Number of nodes indexed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

// === impl Builder ===

/// yaml-rust2 marks have 1-based lines and 0-based columns (its docs say both are
/// 1-based; the tests below pin down what it does).
fn pos(m: &Marker) -> Pos {
    (m.line(), m.col() + 1)
}

enum Frame {
    Map {
        /// `None` inside a part of the document that is not indexed (a complex key).
        path: Option<String>,
        /// The key read, waiting for its value: its text (`None` for a key that is
        /// not a scalar, whose value is not indexed) and position.
        key: Option<(Option<String>, Pos)>,
        /// Char index of the mapping's start mark, until its first key is read.
        start: Option<usize>,
    },
    Seq {
        path: Option<String>,
        next: usize,
    },
}

#[derive(Default)]
struct Builder {
    entries: HashMap<String, Entry>,
    stack: Vec<Frame>,
    /// Depth of a complex (non-scalar) mapping key being skipped.
    skip: usize,
}

enum Role {
    /// A key of the enclosing mapping.
    Key,
    /// A node at this path (or not indexed), named by the key at this position.
    Value(Option<String>, Option<Pos>),
}

impl Builder {
    /// What the next node is: a key of the enclosing mapping, or a value at a path.
    fn role(&mut self) -> Role {
        match self.stack.last_mut() {
            None => Role::Value(Some(String::new()), None),
            Some(Frame::Seq { path, next }) => {
                let p = path.as_deref().map(|p| item(p, *next));
                *next += 1;
                Role::Value(p, None)
            }
            Some(Frame::Map { path, key, .. }) => match key.take() {
                None => Role::Key,
                Some((name, at)) => {
                    let p = path.as_deref().zip(name).map(|(p, n)| field(p, &n));
                    Role::Value(p, Some(at))
                }
            },
        }
    }

    fn record(&mut self, path: Option<&String>, node: Pos, key: Option<Pos>) {
        if let Some(p) = path {
            self.entries.insert(p.clone(), Entry { node, key });
        }
    }

    /// A mapping key was read: remember it and, for a block mapping, move the
    /// mapping's position to its first key (yaml-rust2 marks a block mapping at the
    /// first `:`; a flow mapping's `{` comes before its first key and stays).
    fn key(&mut self, name: String, at: Pos, index: usize) {
        if let Some(Frame::Map { path, key, start }) = self.stack.last_mut() {
            if let Some(s) = start.take() {
                if index < s {
                    if let Some(e) = path.as_ref().and_then(|p| self.entries.get_mut(p)) {
                        e.node = at;
                    }
                }
            }
            *key = Some((Some(name), at));
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        if self.skip > 0 {
            match ev {
                Event::MappingStart(..) | Event::SequenceStart(..) => self.skip += 1,
                Event::MappingEnd | Event::SequenceEnd => self.skip -= 1,
                _ => {}
            }
            if self.skip == 0 {
                // The complex key is done; its value goes unindexed.
                if let Some(Frame::Map { key, .. }) = self.stack.last_mut() {
                    *key = Some((None, pos(&mark)));
                }
            }
            return;
        }
        match ev {
            Event::Scalar(text, style, ..) => match self.role() {
                Role::Key => self.key(text, pos(&mark), mark.index()),
                Role::Value(path, key) => {
                    // An empty value (`match:` and nothing) is marked where the next
                    // token starts, often the next line; its key is where it belongs.
                    let empty = text.is_empty() && style == TScalarStyle::Plain;
                    let node = match key {
                        Some(k) if empty => k,
                        _ => pos(&mark),
                    };
                    self.record(path.as_ref(), node, key);
                }
            },
            Event::Alias(_) => {
                if let Role::Value(path, key) = self.role() {
                    self.record(path.as_ref(), pos(&mark), key);
                } else if let Some(Frame::Map { key, .. }) = self.stack.last_mut() {
                    *key = Some((None, pos(&mark)));
                }
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                let is_map = matches!(ev, Event::MappingStart(..));
                match self.role() {
                    Role::Key => self.skip = 1,
                    Role::Value(path, key) => {
                        self.record(path.as_ref(), pos(&mark), key);
                        self.stack.push(if is_map {
                            Frame::Map {
                                path,
                                key: None,
                                start: Some(mark.index()),
                            }
                        } else {
                            Frame::Seq { path, next: 0 }
                        });
                    }
                }
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd
            | Event::Nothing => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_one_based_lines_and_zero_based_columns() {
        // Pins yaml-rust2's convention, which `pos` converts: the value `b` is on
        // line 1 at the 4th character.
        struct First(Option<(usize, usize)>);
        impl MarkedEventReceiver for First {
            fn on_event(&mut self, ev: Event, mark: Marker) {
                if ev == Event::Scalar("b".into(), TScalarStyle::Plain, 0, None) {
                    self.0 = Some((mark.line(), mark.col()));
                }
            }
        }
        let mut first = First(None);
        Parser::new_from_str("a: b\n")
            .load(&mut first, false)
            .unwrap();
        assert_eq!(first.0, Some((1, 3)));
        assert_eq!(Index::parse("a: b\n").at("a"), Some((1, 4)));
    }

    const DOC: &str = "\
server:
  listen: 0.0.0.0:8080
upstreams:
  api:
    targets: [http://a:1, \"http://b:2\"]
routes:
  - name: login
    match: {path: /login, methods: [POST]}
    limits:
      - {algorithm: sliding_log, limit: 5, window: 1m}
  - name: api
    match:
    max_delay: 2s
    limits:
      -   algorithm: gcra
          rate: 10/s
";

    #[test]
    fn block_and_flow_nodes() {
        let ix = Index::parse(DOC);
        assert_eq!(ix.at(""), Some((1, 1)));
        assert_eq!(ix.at("server"), Some((2, 3)));
        assert_eq!(ix.key_at("server"), Some((1, 1)));
        assert_eq!(ix.at("server.listen"), Some((2, 11)));
        assert_eq!(ix.key_at("server.listen"), Some((2, 3)));
        assert_eq!(ix.at("upstreams.api.targets"), Some((5, 14)));
        assert_eq!(ix.at("upstreams.api.targets[0]"), Some((5, 15)));
        assert_eq!(ix.at("upstreams.api.targets[1]"), Some((5, 27)));
        assert_eq!(ix.at("routes"), Some((7, 3)));
        assert_eq!(ix.at("routes[0]"), Some((7, 5)));
        assert_eq!(ix.key_at("routes[0]"), None);
        assert_eq!(ix.at("routes[0].name"), Some((7, 11)));
        assert_eq!(ix.at("routes[0].match"), Some((8, 12)));
        assert_eq!(ix.at("routes[0].match.path"), Some((8, 19)));
        assert_eq!(ix.at("routes[0].match.methods[0]"), Some((8, 37)));
        assert_eq!(ix.at("routes[0].limits[0]"), Some((10, 9)));
        assert_eq!(ix.at("routes[0].limits[0].window"), Some((10, 52)));
        assert_eq!(ix.at("routes[1]"), Some((11, 5)));
        assert_eq!(ix.key_at("routes[1].max_delay"), Some((13, 5)));
        assert_eq!(ix.at("routes[1].limits[0]"), Some((15, 11)));
        assert_eq!(ix.at("routes[1].limits[0].rate"), Some((16, 17)));
    }

    #[test]
    fn empty_value_is_at_its_key() {
        let ix = Index::parse(DOC);
        assert_eq!(ix.at("routes[1].match"), Some((12, 5)));
        assert_eq!(ix.key_at("routes[1].match"), Some((12, 5)));
    }

    #[test]
    fn missing_nodes_fall_back_to_the_nearest_ancestor() {
        let ix = Index::parse(DOC);
        assert_eq!(ix.at("routes[1].upstream"), None);
        assert_eq!(ix.nearest("routes[1].upstream"), (11, 5));
        assert_eq!(ix.nearest("routes[1].limits[0].burst"), (15, 11));
        assert_eq!(ix.nearest("routes[7].name"), (7, 3));
        assert_eq!(ix.nearest("store.redis.url"), (1, 1));
        assert_eq!(ix.nearest_key("routes[1].max_delay"), (13, 5));
        assert_eq!(ix.nearest_key("routes[1].on_limit"), (11, 5));
        assert_eq!(Index::parse("").nearest("routes"), (1, 1));
    }

    #[test]
    fn odd_keys_are_quoted_in_paths() {
        let ix = Index::parse("upstreams:\n  a.b:\n    targets: []\n  \"\": x\n");
        assert_eq!(field("upstreams", "a.b"), "upstreams[\"a.b\"]");
        assert_eq!(ix.at("upstreams[\"a.b\"].targets"), Some((3, 14)));
        assert_eq!(ix.at("upstreams[\"\"]"), Some((4, 7)));
        assert_eq!(ix.nearest("upstreams[\"a.b\"].timeout"), (3, 5));
    }

    #[test]
    fn parents() {
        assert_eq!(
            parent("routes[1].limits[0].window"),
            Some("routes[1].limits[0]")
        );
        assert_eq!(parent("routes[1].limits[0]"), Some("routes[1].limits"));
        assert_eq!(parent("routes[1]"), Some("routes"));
        assert_eq!(parent("routes"), Some(""));
        assert_eq!(parent(""), None);
        assert_eq!(parent("u[\"a.\\\"]b\"].t"), Some("u[\"a.\\\"]b\"]"));
        assert_eq!(parent("u[\"a.\\\"]b\"]"), Some("u"));
    }

    #[test]
    fn complex_keys_aliases_and_errors_do_not_derail() {
        let ix = Index::parse("? [a, b]\n: {c: 1}\nd: &x {e: 1}\nf: *x\ng: 2\n");
        assert_eq!(ix.at("d.e"), Some((3, 11)));
        assert_eq!(ix.at("f"), Some((4, 4)));
        assert_eq!(ix.nearest("f.e"), (4, 4));
        assert_eq!(ix.at("g"), Some((5, 4)));
        let ix = Index::parse("a: 1\nb: [\n");
        assert_eq!(ix.at("a"), Some((1, 4)));
    }

    #[test]
    fn byte_order_mark_and_crlf() {
        let ix = Index::parse("\u{feff}a: 1\r\nb: 2\r\n");
        assert_eq!(ix.at("a"), Some((1, 4)));
        assert_eq!(ix.at("b"), Some((2, 4)));
    }
}
