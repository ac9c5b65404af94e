//! Keys as text: the forms a key is compared in (`normalize_key`), which characters
//! a body key may hold, and when two member names are one to an upstream that
//! ignores case. Unicode's tables come from maintained crates
//! (`unicode-normalization`, `caseless`, `unicode-properties`), never from here.

use std::borrow::Cow;

use caseless::Caseless;
use unicode_normalization::{is_nfc_quick, IsNormalized, UnicodeNormalization};
use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};

/// How a key is compared (`normalize_key`): as sent, case-folded, or as an e-mail
/// address. Deny-list keys are matched in the same form.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Normalize {
    /// The key as sent (body keys in NFC).
    #[default]
    None,
    /// Unicode NFKC case folding: `carl`, `Carl`, `CARL` and `ｃａｒｌ` are one key.
    Casefold,
    /// `casefold`, and a `+tag` dropped from the local part of an address:
    /// `Carl+news@Example.com` is `carl@example.com`.
    Email,
}

impl Normalize {
    /// The forms other than `none`, in the order the deny list indexes them.
    pub const FOLDED: [Normalize; 2] = [Normalize::Casefold, Normalize::Email];

    pub fn as_str(self) -> &'static str {
        match self {
            Normalize::None => "none",
            Normalize::Casefold => "casefold",
            Normalize::Email => "email",
        }
    }

    /// `key` in this form; borrowed when it is in it already.
    pub fn apply(self, key: Cow<'_, str>) -> Cow<'_, str> {
        match self {
            Normalize::None => key,
            Normalize::Casefold => casefold_cow(key),
            Normalize::Email => match casefold_cow(key) {
                Cow::Borrowed(k) => untagged(k).map_or(Cow::Borrowed(k), Cow::Owned),
                Cow::Owned(k) => Cow::Owned(untagged(&k).unwrap_or(k)),
            },
        }
    }
}

impl std::fmt::Display for Normalize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn casefold_cow(key: Cow<'_, str>) -> Cow<'_, str> {
    match key {
        Cow::Borrowed(k) => casefold(k),
        Cow::Owned(k) => match casefold(&k) {
            Cow::Borrowed(_) => Cow::Owned(k),
            Cow::Owned(f) => Cow::Owned(f),
        },
    }
}

/// Unicode NFKC case folding (`toNFKC_Casefold`, but for its removal of
/// default-ignorable characters, which no body key may hold: `is_text_key`;
/// header, query and cookie keys are ASCII): compatibility forms composed
/// (fullwidth `ｃ` is `c`), cases folded in full (`ß` is `ss`, final `ς` is `σ`,
/// `K` the Kelvin sign is `k`), and composed again. ASCII costs a lower-casing.
pub fn casefold(key: &str) -> Cow<'_, str> {
    if key.is_ascii() {
        return if key.bytes().any(|b| b.is_ascii_uppercase()) {
            Cow::Owned(key.to_ascii_lowercase())
        } else {
            Cow::Borrowed(key)
        };
    }
    // Folding can leave a text that composes into a foldable character, and
    // composing one that folds again (rare): repeat until nothing changes, so the
    // form is stable (casefold(casefold(k)) == casefold(k)).
    let mut folded: String = key.nfkc().default_case_fold().nfkc().collect();
    for _ in 0..3 {
        let again: String = folded.chars().default_case_fold().nfkc().collect();
        if again == folded {
            break;
        }
        folded = again;
    }
    if folded == key {
        Cow::Borrowed(key)
    } else {
        Cow::Owned(folded)
    }
}

/// An address without the `+tag` of its local part (`carl+news@x` is `carl@x`);
/// None when there is none to drop. The local part ends at the last `@`; a local
/// part that is only a tag is kept.
fn untagged(key: &str) -> Option<String> {
    let at = key.rfind('@')?;
    let plus = key[..at].find('+').filter(|&p| p > 0)?;
    Some(format!("{}{}", &key[..plus], &key[at..]))
}

/// `key` in form `n` when it is a whole key as stored, a composite one's parts
/// joined by `|` (with `\\` escapes, as `KeySpec` joins them): each part in its
/// form, joined again.
pub fn normalize_joined(n: Normalize, key: &str) -> Cow<'_, str> {
    if n == Normalize::None || !key.contains('|') {
        return n.apply(Cow::Borrowed(key));
    }
    let mut parts = vec![String::new()];
    let mut chars = key.chars();
    while let Some(c) = chars.next() {
        let part = parts.last_mut().expect("one part at least");
        match c {
            '\\' => part.extend(chars.next()),
            '|' => parts.push(String::new()),
            c => part.push(c),
        }
    }
    let mut joined = String::with_capacity(key.len());
    for (i, p) in parts.into_iter().enumerate() {
        if i > 0 {
            joined.push('|');
        }
        for c in n.apply(Cow::Owned(p)).chars() {
            if c == '|' || c == '\\' {
                joined.push('\\');
            }
            joined.push(c);
        }
    }
    Cow::Owned(joined)
}

/// A body key's text in NFC, so composed and decomposed spellings (`José` with
/// `é` or with `e` and U+0301) are one key; borrowed when it is NFC already.
pub fn nfc(key: Cow<'_, str>) -> Cow<'_, str> {
    if key.is_ascii() || is_nfc_quick(key.chars()) == IsNormalized::Yes {
        return key;
    }
    let composed: String = key.nfc().collect();
    if composed == *key {
        key
    } else {
        Cow::Owned(composed)
    }
}

/// Whether a body key's text holds only characters a name can: letters, marks,
/// digits, punctuation, symbols and spaces of any script. Control, format (bidi
/// controls, zero-width joiners, the soft hyphen), private-use, surrogate and
/// unassigned characters are not, nor U+FFFD (bytes that were not UTF-8): an
/// upstream may drop or read them otherwise, so the same name would be two keys.
pub fn is_text_key(key: &str) -> bool {
    key.is_ascii() && key.bytes().all(|b| (0x20..=0x7e).contains(&b))
        || key.chars().all(|c| {
            // Bytes that were not UTF-8, and the default-ignorable characters
            // that are not format characters (DerivedCoreProperties.txt): the
            // grapheme joiner, variation selectors, Mongolian free variation
            // selectors, Khmer inherent vowels and Hangul fillers. They are
            // invisible, and a folding reader drops them (`toNFKC_Casefold`,
            // MySQL's collations): `mallory` with one is `mallory` to it.
            !matches!(
                c,
                '\u{FFFD}'
                    | '\u{034F}'
                    | '\u{115F}'
                    | '\u{1160}'
                    | '\u{17B4}'
                    | '\u{17B5}'
                    | '\u{180B}'..='\u{180D}'
                    | '\u{180F}'
                    | '\u{3164}'
                    | '\u{FE00}'..='\u{FE0F}'
                    | '\u{FFA0}'
                    | '\u{E0100}'..='\u{E01EF}'
            ) && !matches!(
                c.general_category(),
                GeneralCategory::Control
                    | GeneralCategory::Format
                    | GeneralCategory::PrivateUse
                    | GeneralCategory::Surrogate
                    | GeneralCategory::Unassigned
            )
        })
}

/// Whether `key` can be some request's key, as a deny-list entry or an override
/// names it: text a key may hold (`is_text_key`) with no white space around it
/// (every key is read trimmed).
pub fn can_be_a_key(key: &str) -> bool {
    is_text_key(key) && key.trim() == key
}

/// Whether a JSON member `name` is the member `token` to an upstream that matches
/// names ignoring case: Go's `encoding/json` (Unicode simple folding: `USER`,
/// `uſer` and `uſER` are `user`) and ASP.NET's web defaults. Compared character by
/// character under full case folding, which takes every pair simple folding takes
/// (and a few more, such as `ẞ` for `ß`): a wider rule only turns more bodies into
/// repeats.
pub fn same_member(name: &str, token: &str) -> bool {
    if name.len() == token.len() && name.eq_ignore_ascii_case(token) {
        return true;
    }
    if name.is_ascii() && token.is_ascii() {
        return false;
    }
    let (mut a, mut b) = (name.chars(), token.chars());
    loop {
        match (a.next(), b.next()) {
            (None, None) => return true,
            (Some(x), Some(y)) => {
                let same = x == y
                    || std::iter::once(x)
                        .default_case_fold()
                        .eq(std::iter::once(y).default_case_fold());
                if !same {
                    return false;
                }
            }
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(n: Normalize, k: &str) -> String {
        n.apply(Cow::Borrowed(k)).into_owned()
    }

    /// Which spellings are one key under each form, and which stay apart.
    #[test]
    fn normalize_key_table() {
        use Normalize::{Casefold, Email, None};
        for (form, sent, key) in [
            (None, "Carl", "Carl"),
            (Casefold, "carl", "carl"),
            (Casefold, "Carl", "carl"),
            (Casefold, "CARL", "carl"),
            (Casefold, "cArl", "carl"),
            // Fullwidth letters and digits are their ASCII forms (NFKC).
            (Casefold, "ｃａｒｌ", "carl"),
            (Casefold, "ＣＡＲＬ１２", "carl12"),
            // German: ß and ẞ fold to ss.
            (Casefold, "Straße", "strasse"),
            (Casefold, "STRASSE", "strasse"),
            (Casefold, "STRAẞE", "strasse"),
            // Greek: final sigma is sigma.
            (Casefold, "ΟΔΥΣΣΕΥΣ", "οδυσσευσ"),
            (Casefold, "Οδυσσευς", "οδυσσευσ"),
            // Turkish: İ folds to i and a combining dot; dotless ı stays itself
            // (the default folding, not Turkish rules).
            (Casefold, "İ", "i\u{307}"),
            (Casefold, "ı", "ı"),
            (Casefold, "I", "i"),
            // The Kelvin sign and the long s.
            (Casefold, "\u{212A}arl", "karl"),
            (Casefold, "u\u{17F}er", "user"),
            // Combining marks: composed and decomposed are one key.
            (Casefold, "JOSE\u{301}", "josé"),
            (Casefold, "José", "josé"),
            // Ligatures are their letters.
            (Casefold, "ﬀ", "ff"),
            (Email, "Carl@Example.com", "carl@example.com"),
            (Email, "carl+news@example.com", "carl@example.com"),
            (Email, "Carl+a+b@EXAMPLE.COM", "carl@example.com"),
            (Email, "ｃａｒｌ＋x@example.com", "carl@example.com"),
            // A `+` in the domain part is not a tag; the local part ends at the last @.
            (Email, "carl@ex+ample.com", "carl@ex+ample.com"),
            (Email, "a@b+c@example.com", "a@b@example.com"),
            (Email, "a+t@b@example.com", "a@example.com"),
            // Only a tag: kept. No @: casefold alone.
            (Email, "+news@example.com", "+news@example.com"),
            (Email, "Carl+x", "carl+x"),
        ] {
            assert_eq!(norm(form, sent), key, "{form} {sent:?}");
            // Stable: a key in its form stays in it.
            assert_eq!(norm(form, key), key, "{form} {key:?} again");
        }
        // Apart: these are different people.
        for (a, b) in [("carl", "karl"), ("i", "ı"), ("ss", "s"), ("jose", "josé")] {
            assert_ne!(norm(Casefold, a), norm(Casefold, b), "{a} {b}");
        }
    }

    #[test]
    fn ascii_in_its_form_is_borrowed() {
        assert!(matches!(
            Normalize::Casefold.apply(Cow::Borrowed("carl")),
            Cow::Borrowed("carl")
        ));
        assert!(matches!(
            Normalize::Email.apply(Cow::Borrowed("carl@x.io")),
            Cow::Borrowed("carl@x.io")
        ));
        assert!(matches!(nfc(Cow::Borrowed("José")), Cow::Borrowed(_)));
        assert_eq!(nfc(Cow::Borrowed("Jose\u{301}")), "José");
    }

    #[test]
    fn text_keys() {
        for ok in [
            "José",
            "carl",
            "Jean Luc",
            "Ōtani",
            "Иван",
            "李小龍",
            "محمد",
            "😀",
            "a-b_c.d@e",
        ] {
            assert!(is_text_key(ok), "{ok:?}");
        }
        for bad in [
            "carl\u{0}",
            "carl\u{7}",
            "car\u{200B}l",     // zero-width space (Cf)
            "car\u{200D}l",     // zero-width joiner
            "\u{202E}lrac",     // right-to-left override
            "car\u{AD}l",       // soft hyphen
            "carl\u{E000}",     // private use
            "carl\u{F0000}",    // private use plane 15
            "carl\u{0378}",     // unassigned
            "carl\u{FFFD}",     // replaced bytes
            "carl\u{FEFF}",     // byte order mark (Cf)
            "carl\u{7F}",       // DEL
            "carl\u{85}",       // NEL (Cc)
            "bad\u{3164}",      // Hangul filler
            "mallory\u{34F}",   // combining grapheme joiner
            "mal\u{FE00}lory",  // variation selector
            "mallory\u{180B}",  // Mongolian free variation selector
            "mallory\u{E0100}", // variation selector 17
        ] {
            assert!(!is_text_key(bad), "{bad:?}");
        }
    }

    #[test]
    fn member_names_as_go_reads_them() {
        for (name, token) in [
            ("user", "user"),
            ("USER", "user"),
            ("uSeR", "user"),
            ("u\u{17F}er", "user"), // long s
            ("U\u{17F}ER", "user"),
            ("\u{212A}ey", "key"), // Kelvin sign
            ("STRAẞE", "straße"),
            ("ΣΟΦΙΑ", "σοφια"),
        ] {
            assert!(same_member(name, token), "{name:?} {token:?}");
        }
        for (name, token) in [
            ("users", "user"),
            ("use", "user"),
            ("ｕｓｅｒ", "user"), // fullwidth: Go reads it as another name
            ("us\u{0}er", "user"),
            ("ıser", "iser"), // dotless i
            ("İser", "iser"), // dotted capital I
            ("strasse", "straße"),
            ("user ", "user"),
        ] {
            assert!(!same_member(name, token), "{name:?} {token:?}");
        }
    }
}
