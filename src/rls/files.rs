//! envoyproxy/ratelimit's configuration files, read as they are: one `domain` per
//! file, its `descriptors` a tree of (key, value) nodes, a node's `rate_limit` the
//! limit of the descriptors whose last entry reaches it. Unknown fields are errors
//! with file, line and column, as in `rules.yaml`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::config::locate::{self, Index};
use crate::config::{ConfigError, ConfigErrors};
use crate::limit::{Algorithm, LimitDef, Rate};

// === the files as written ===

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    domain: String,
    #[serde(default)]
    descriptors: Option<Vec<DescriptorSpec>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorSpec {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RateLimitSpec>,
    #[serde(default)]
    descriptors: Option<Vec<DescriptorSpec>>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    share_threshold: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitSpec {
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    requests_per_unit: u32,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<ReplacesSpec>,
    /// sluice's: any of its algorithms over the unit (default `fixed_window`).
    #[serde(default)]
    algorithm: Option<String>,
    /// sluice's: token_bucket's and gcra's burst (default `requests_per_unit`).
    #[serde(default)]
    burst: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplacesSpec {
    name: String,
}

// === what a file compiles into ===

/// envoyproxy/ratelimit's units. Windows are aligned to the Unix epoch (UTC), a
/// month is 30 days and a year 365, as envoyproxy/ratelimit counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    pub fn parse(s: &str) -> Option<Unit> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// The unit of the protocol's `RateLimit.Unit` number; None for UNKNOWN.
    pub fn from_proto(n: i32) -> Option<Unit> {
        Some(match n {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }

    /// The protocol's number for this unit.
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }
}

/// A node's `rate_limit`, compiled.
#[derive(Debug)]
pub struct Rule {
    /// The node's place: its `key` or `key_value` and those of its ancestors, joined
    /// by `.` (envoyproxy/ratelimit's stats key without the domain). Bounded by the
    /// file, it names the rule in metrics and its state in the store.
    pub path: String,
    pub requests_per_unit: u32,
    pub unit: Unit,
    /// `rate_limit.name` ("" when absent).
    pub name: String,
    /// Answers OK with 4294967295 remaining; counts nothing.
    pub unlimited: bool,
    pub shadow: bool,
    pub detailed_metric: bool,
    /// The names of the rules this one replaces in a call that reaches both.
    pub replaces: Vec<String>,
    /// What the store decides, with cost 1 (a call's `hits_addend` sets its own).
    /// None for `unlimited`.
    pub limit: Option<LimitDef>,
}

impl Rule {
    /// The limit a descriptor's `limit` override asks for: a fixed window, counted
    /// apart from the configured rules' states under a name no file node has in
    /// practice, and counted in metrics with `_none`.
    pub fn overriding(requests_per_unit: u32, unit: Unit) -> Rule {
        let algorithm = Algorithm::FixedWindow {
            limit: u64::from(requests_per_unit),
            window_us: unit.seconds() * 1_000_000,
        };
        Rule {
            path: "(limit override)".into(),
            requests_per_unit,
            unit,
            name: String::new(),
            unlimited: false,
            shadow: false,
            detailed_metric: false,
            replaces: Vec::new(),
            limit: Some(LimitDef::new("(limit override)".into(), algorithm, 1)),
        }
    }
}

/// One node of a domain's tree.
#[derive(Debug, Default)]
struct Node {
    /// Children by `key_value` (a value given) or `key` (the key's default), as
    /// envoyproxy/ratelimit names them.
    children: HashMap<String, Node>,
    /// Children whose value has a `*`: their `key_value` split at each `*`, in file
    /// order.
    wildcards: Vec<(String, Vec<String>)>,
    rule: Option<Arc<Rule>>,
    /// `share_threshold`: every value the wildcard matches counts as one.
    shared_value: Option<String>,
}

/// One file's domain.
#[derive(Debug)]
pub struct Domain {
    pub name: String,
    pub file: PathBuf,
    root: Node,
    /// Every rule, in file order.
    pub rules: Vec<Arc<Rule>>,
}

/// Where a descriptor's entries lead in a domain.
pub struct Found<'a> {
    pub rule: Option<&'a Arc<Rule>>,
    /// The values to count by: each entry's value, or for a `share_threshold`
    /// wildcard its pattern.
    pub shared: Vec<Option<&'a str>>,
}

impl Domain {
    /// The rule of the node the last of `entries` reaches (value match first, then
    /// a wildcard, then the key's default), as envoyproxy/ratelimit's `GetLimit`.
    pub fn find<'a>(&'a self, entries: &[(&str, &str)]) -> Found<'a> {
        let mut node = &self.root;
        let mut shared = vec![None; entries.len()];
        let mut rule = None;
        for (i, (key, value)) in entries.iter().enumerate() {
            let with_value = format!("{key}_{value}");
            let mut next = node.children.get(&with_value);
            if next.is_none() {
                next = node
                    .wildcards
                    .iter()
                    .find(|(_, parts)| wildcard_match(parts, &with_value))
                    .and_then(|(k, _)| node.children.get(k));
                if let Some(n) = next {
                    shared[i] = n.shared_value.as_deref();
                }
            }
            if next.is_none() {
                next = node.children.get(*key);
            }
            let Some(n) = next else { break };
            if i == entries.len() - 1 {
                rule = n.rule.as_ref();
            }
            if n.children.is_empty() {
                break;
            }
            node = n;
        }
        Found { rule, shared }
    }
}

/// envoyproxy/ratelimit's wildcard: the parts of a pattern split at `*` appear in
/// `value` in order, the first at its start and the last at its end.
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    if !value.starts_with(first.as_str()) || !value.ends_with(last.as_str()) {
        return false;
    }
    if value.len() < parts.iter().map(String::len).sum::<usize>() {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// Every domain of a folder, by name.
#[derive(Debug, Default)]
pub struct Domains {
    pub by_name: HashMap<String, Arc<Domain>>,
    /// Hex SHA-1 of the files' names and bytes: names this version of the folder.
    pub hash: String,
}

impl Domains {
    /// The domains' names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }
}

/// The YAML files of `dir` (`*.yaml`, `*.yml`; hidden ones, as Kubernetes'
/// `..data` links, left out), sorted by name.
fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>, ConfigErrors> {
    let read = std::fs::read_dir(dir).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            file: dir.to_path_buf(),
            line: 0,
            col: 0,
            message: format!("cannot read rls.config_dir: {e}"),
        }])
    })?;
    let mut files: Vec<PathBuf> = read
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            !name.starts_with('.')
                && (name.ends_with(".yaml") || name.ends_with(".yml"))
                && p.is_file()
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Reads and checks every file of `dir`: all of them, or every error found.
pub fn load_dir(dir: &Path) -> Result<Domains, ConfigErrors> {
    let mut errors = Vec::new();
    let mut by_name: HashMap<String, Arc<Domain>> = HashMap::new();
    let mut hasher = sha1_smol::Sha1::new();
    for path in yaml_files(dir)? {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                errors.push(at(&path, (0, 0), format!("cannot read: {e}")));
                continue;
            }
        };
        hasher.update(path.as_os_str().as_encoded_bytes());
        hasher.update(text.as_bytes());
        match parse(&text, &path) {
            Ok(domain) => {
                if let Some(other) = by_name.get(&domain.name) {
                    let index = Index::parse(&text);
                    errors.push(at(
                        &path,
                        index.nearest("domain"),
                        format!(
                            "domain {:?} is also that of {}",
                            domain.name,
                            other.file.display()
                        ),
                    ));
                    continue;
                }
                by_name.insert(domain.name.clone(), Arc::new(domain));
            }
            Err(mut e) => errors.append(&mut e.0),
        }
    }
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    Ok(Domains {
        by_name,
        hash: hasher.digest().to_string(),
    })
}

fn at(file: &Path, (line, col): (usize, usize), message: String) -> ConfigError {
    ConfigError {
        file: file.to_path_buf(),
        line,
        col,
        message,
    }
}

/// One file's domain, or its errors (each at its node).
pub fn parse(text: &str, path: &Path) -> Result<Domain, ConfigErrors> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let spec: FileSpec = serde_yaml::from_str(text)
        .map_err(|e| ConfigErrors(vec![crate::config::yaml_error(&e, path)]))?;
    let index = Index::parse(text);
    let mut errors = Vec::new();
    if spec.domain.is_empty() {
        errors.push(at(
            path,
            index.nearest("domain"),
            "domain must not be empty".into(),
        ));
    }
    let mut rules = Vec::new();
    let mut root = Node::default();
    let mut cx = Build {
        path,
        index: &index,
        errors: &mut errors,
        rules: &mut rules,
    };
    cx.nodes(
        &mut root,
        "",
        "descriptors",
        spec.descriptors.as_deref().unwrap_or(&[]),
    );
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    Ok(Domain {
        name: spec.domain,
        file: path.to_path_buf(),
        root,
        rules,
    })
}

struct Build<'a> {
    path: &'a Path,
    index: &'a Index,
    errors: &'a mut Vec<ConfigError>,
    rules: &'a mut Vec<Arc<Rule>>,
}

impl Build<'_> {
    fn error(&mut self, node: &str, message: String) {
        self.errors
            .push(at(self.path, self.index.nearest(node), message));
    }

    fn nodes(&mut self, parent: &mut Node, prefix: &str, at: &str, specs: &[DescriptorSpec]) {
        for (i, d) in specs.iter().enumerate() {
            let here = locate::item(at, i);
            if d.key.is_empty() {
                self.error(
                    &locate::field(&here, "key"),
                    "descriptor has empty key".into(),
                );
                continue;
            }
            let value = d.value.as_deref().filter(|v| !v.is_empty());
            let name = match value {
                Some(v) => format!("{}_{v}", d.key),
                None => d.key.clone(),
            };
            let path = format!("{prefix}{name}");
            if parent.children.contains_key(&name) {
                self.error(
                    &locate::field(&here, "key"),
                    format!("duplicate descriptor composite key '{path}'"),
                );
                continue;
            }
            if d.share_threshold && !name.contains('*') {
                self.error(
                    &locate::field(&here, "share_threshold"),
                    format!("share_threshold can only be used with wildcard values (containing '*'), but found key '{name}'"),
                );
            }
            let mut node = Node::default();
            if let Some(r) = &d.rate_limit {
                if let Some(rule) = self.rule(r, d, &path, &locate::field(&here, "rate_limit")) {
                    let rule = Arc::new(rule);
                    self.rules.push(rule.clone());
                    node.rule = Some(rule);
                }
            }
            if name.contains('*') {
                parent
                    .wildcards
                    .push((name.clone(), name.split('*').map(str::to_string).collect()));
                if d.share_threshold {
                    node.shared_value = value.map(str::to_string);
                }
            }
            self.nodes(
                &mut node,
                &format!("{path}."),
                &locate::field(&here, "descriptors"),
                d.descriptors.as_deref().unwrap_or(&[]),
            );
            parent.children.insert(name, node);
        }
    }

    fn rule(
        &mut self,
        r: &RateLimitSpec,
        d: &DescriptorSpec,
        path: &str,
        at: &str,
    ) -> Option<Rule> {
        let unit = r.unit.as_deref().and_then(Unit::parse);
        let name = r.name.clone().unwrap_or_default();
        for (i, rep) in r.replaces.iter().enumerate() {
            let here = locate::field(&locate::item(&locate::field(at, "replaces"), i), "name");
            if rep.name.is_empty() {
                self.error(&here, "should not have an empty replaces entry".into());
            } else if rep.name == name {
                self.error(
                    &here,
                    "replaces should not contain name of same descriptor".into(),
                );
            }
        }
        if r.unlimited {
            if unit.is_some() {
                self.error(
                    &locate::field(at, "unit"),
                    "should not specify rate limit unit when unlimited".into(),
                );
                return None;
            }
            return Some(Rule {
                path: path.to_string(),
                requests_per_unit: r.requests_per_unit,
                unit: Unit::Second,
                name,
                unlimited: true,
                shadow: d.shadow_mode,
                detailed_metric: d.detailed_metric,
                replaces: r.replaces.iter().map(|x| x.name.clone()).collect(),
                limit: None,
            });
        }
        let Some(unit) = unit else {
            self.error(
                &locate::field(at, "unit"),
                format!(
                    "invalid rate limit unit '{}': expected second, minute, hour, day, week, month or year",
                    r.unit.as_deref().unwrap_or("")
                ),
            );
            return None;
        };
        let window_us = unit.seconds() * 1_000_000;
        let count = u64::from(r.requests_per_unit);
        let algorithm = match r.algorithm.as_deref().unwrap_or("fixed_window") {
            "fixed_window" => Algorithm::FixedWindow {
                limit: count,
                window_us,
            },
            "sliding_window" => Algorithm::SlidingWindow {
                limit: count,
                window_us,
            },
            "sliding_log" if count <= MAX_LOG => Algorithm::SlidingLog {
                limit: count,
                window_us,
            },
            "sliding_log" => {
                self.error(
                    &locate::field(at, "requests_per_unit"),
                    format!("sliding_log keeps every request: at most {MAX_LOG} requests_per_unit"),
                );
                return None;
            }
            a @ ("token_bucket" | "gcra") => {
                if count == 0 {
                    self.error(
                        &locate::field(at, "requests_per_unit"),
                        format!("{a} needs requests_per_unit of at least 1"),
                    );
                    return None;
                }
                let rate = Rate {
                    count,
                    per_us: window_us,
                };
                let burst = r.burst.unwrap_or(count).max(1);
                if a == "gcra" {
                    Algorithm::Gcra { rate, burst }
                } else {
                    Algorithm::TokenBucket { rate, burst }
                }
            }
            other => {
                self.error(
                    &locate::field(at, "algorithm"),
                    format!("unknown algorithm '{other}': expected fixed_window, sliding_window, sliding_log, token_bucket or gcra"),
                );
                return None;
            }
        };
        if r.burst.is_some()
            && !matches!(
                algorithm,
                Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. }
            )
        {
            self.error(
                &locate::field(at, "burst"),
                "burst is for token_bucket and gcra only".into(),
            );
            return None;
        }
        Some(Rule {
            path: path.to_string(),
            requests_per_unit: r.requests_per_unit,
            unit,
            name,
            unlimited: false,
            shadow: d.shadow_mode,
            detailed_metric: d.detailed_metric,
            replaces: r.replaces.iter().map(|x| x.name.clone()).collect(),
            limit: Some(LimitDef::new(path.to_string(), algorithm, 1)),
        })
    }
}

/// The most requests a sliding_log rule may keep per key.
const MAX_LOG: u64 = 10_000;

#[cfg(test)]
mod tests {
    use super::*;

    fn domain(text: &str) -> Domain {
        parse(text, Path::new("d.yaml")).expect("a valid file")
    }

    fn errors(text: &str) -> Vec<String> {
        match parse(text, Path::new("d.yaml")) {
            Ok(_) => panic!("accepted: {text}"),
            Err(e) => e.0.iter().map(ToString::to_string).collect(),
        }
    }

    fn path_of(d: &Domain, entries: &[(&str, &str)]) -> Option<String> {
        d.find(entries).rule.map(|r| r.path.clone())
    }

    #[test]
    fn a_descriptor_gets_the_limit_of_the_node_its_last_entry_reaches() {
        let d = domain(
            "domain: d\ndescriptors:\n  - key: k1\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: k2\n    value: v2\n    rate_limit: {unit: minute, requests_per_unit: 3}\n    descriptors:\n      - key: inner\n        rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: k2\n    rate_limit: {unit: day, requests_per_unit: 1}\n  - key: path\n    value: /api/*\n    share_threshold: true\n    rate_limit: {unit: second, requests_per_unit: 7}\n",
        );
        assert_eq!(path_of(&d, &[("k1", "anything")]), Some("k1".into()));
        assert_eq!(path_of(&d, &[("k2", "v2")]), Some("k2_v2".into()));
        assert_eq!(path_of(&d, &[("k2", "other")]), Some("k2".into()));
        assert_eq!(
            path_of(&d, &[("k2", "v2"), ("inner", "x")]),
            Some("k2_v2.inner".into())
        );
        // The last entry reaches no node with a limit: none, not the parent's.
        assert_eq!(path_of(&d, &[("k2", "v2"), ("nothing", "x")]), None);
        assert_eq!(path_of(&d, &[("k1", "a"), ("k1", "b")]), None);
        assert_eq!(path_of(&d, &[("unknown", "x")]), None);
        let found = d.find(&[("path", "/api/users")]);
        assert_eq!(found.rule.map(|r| r.path.as_str()), Some("path_/api/*"));
        assert_eq!(found.shared, vec![Some("/api/*")]);
        assert_eq!(path_of(&d, &[("path", "/other")]), None);
        let rule = d.find(&[("k2", "v2")]).rule.cloned().expect("a rule");
        assert_eq!((rule.requests_per_unit, rule.unit), (3, Unit::Minute));
    }

    #[test]
    fn wildcards_match_as_envoyproxy_ratelimit_matches_them() {
        let parts = |p: &str| p.split('*').map(str::to_string).collect::<Vec<_>>();
        assert!(wildcard_match(&parts("k_/a/*"), "k_/a/b/c"));
        assert!(wildcard_match(&parts("k_/a/*"), "k_/a/"));
        assert!(!wildcard_match(&parts("k_/a/*"), "k_/b"));
        assert!(wildcard_match(&parts("k_a*b*c"), "k_aXbYc"));
        assert!(!wildcard_match(&parts("k_a*b*c"), "k_aXc"));
        assert!(!wildcard_match(&parts("k_ab*ba"), "k_aba"));
    }

    #[test]
    fn unknown_fields_and_bad_values_are_errors_at_their_node() {
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limt: {unit: second}\n"),
            ["d.yaml:4:5: descriptors[0]: unknown field `rate_limt`, expected one of `key`, `value`, `rate_limit`, `descriptors`, `shadow_mode`, `detailed_metric`, `share_threshold`"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n"),
            ["d.yaml:5:13: invalid rate limit unit 'fortnight': expected second, minute, hour, day, week, month or year"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n"),
            ["d.yaml:5:10: duplicate descriptor composite key 'k'"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: second}\n"),
            ["d.yaml:4:41: should not specify rate limit unit when unlimited"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {name: a, unit: second, replaces: [{name: a}]}\n"),
            ["d.yaml:4:59: replaces should not contain name of same descriptor"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n"),
            ["d.yaml:4:65: unknown algorithm 'leaky': expected fixed_window, sliding_window, sliding_log, token_bucket or gcra"]
        );
    }

    #[test]
    fn units_count_seconds_as_envoyproxy_ratelimit_does() {
        let all = [
            (Unit::Second, 1),
            (Unit::Minute, 60),
            (Unit::Hour, 3600),
            (Unit::Day, 86_400),
            (Unit::Week, 604_800),
            (Unit::Month, 2_592_000),
            (Unit::Year, 31_536_000),
        ];
        for (u, s) in all {
            assert_eq!(u.seconds(), s);
            assert_eq!(Unit::from_proto(u.proto()), Some(u));
            assert_eq!(Unit::parse(&u.name().to_uppercase()), Some(u));
        }
    }

    #[test]
    fn a_folder_is_every_file_or_every_error() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let write =
            |name: &str, text: &str| std::fs::write(dir.path().join(name), text).expect("written");
        write("a.yaml", "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
        write("b.yml", "domain: b\n");
        write("notes.txt", "not yaml: [");
        let d = load_dir(dir.path()).expect("loaded");
        assert_eq!(d.names(), ["a", "b"]);
        write("c.yaml", "domain: a\n");
        let e = load_dir(dir.path()).expect_err("a domain twice");
        assert_eq!(e.0.len(), 1);
        let a = dir.path().join("a.yaml");
        let c = dir.path().join("c.yaml");
        assert_eq!(
            e.0[0].to_string(),
            format!(
                "{}:1:9: domain \"a\" is also that of {}",
                c.display(),
                a.display()
            )
        );
    }
}
