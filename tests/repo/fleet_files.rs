//! The Docker fleet of `docker/` (compose file, fleet configuration, Prometheus and
//! its alert rules, Grafana's provisioning and dashboard), checked as far as it can
//! be without a Docker engine:
//!
//! - every YAML and JSON file parses;
//! - every path the files name exists: compose build contexts and Dockerfile, bind
//!   mounts, the Dockerfile's COPY sources (and what the crate reads at compile time
//!   lies under them), Prometheus' rule files and Grafana's dashboards, each found
//!   through the compose mounts as the container sees it;
//! - `promtool check config`, `promtool check rules` and `promtool test rules` pass,
//!   and every dashboard query is valid PromQL;
//! - every metric name in the alerts and the dashboard is one a live sluice, running
//!   the fleet's own files on a real Redis in front of the demo upstream, exports;
//!   with that Redis killed, SluiceStoreErrors fires on the gateway's real scrapes
//!   (`promtool test rules`);
//! - every health check is `sluice health --admin http://127.0.0.1:9091` and
//!   passes against the live processes, with Redis up, with Redis down and with a
//!   typo saved into the configuration;
//! - the fleet configuration passes `sluice check`, on the admin port Prometheus
//!   scrapes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Output};

use crate::common::redis::RedisServer;
use crate::common::*;
use serde_json::Value as Json;
use serde_yaml::Value as Yaml;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");
const TOKEN: &str = "fleet-test-token";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn docker() -> PathBuf {
    root().join("docker")
}

// === reading the files ===

/// Every file under `dir`, sorted.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                todo.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A YAML file with its `<<` merge keys applied (the compose file uses them).
fn yaml(path: &Path) -> Yaml {
    let mut v: Yaml = serde_yaml::from_str(&read(path))
        .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()));
    v.apply_merge()
        .unwrap_or_else(|e| panic!("{}: bad merge key: {e}", path.display()));
    v
}

fn json(path: &Path) -> Json {
    serde_json::from_str(&read(path))
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()))
}

fn rel(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// `base/p` with `.` and `..` resolved by name (the path need not exist).
fn join_clean(base: &Path, p: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for c in base.join(p).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

fn str_of<'a>(v: &'a Yaml, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what}: expected a string, found {v:?}"))
}

// === the compose file ===

/// One bind mount: the host path (resolved against docker/) and where the
/// container sees it.
#[derive(Debug, Clone)]
struct Mount {
    host: PathBuf,
    target: String,
}

struct Compose {
    services: BTreeMap<String, Yaml>,
}

impl Compose {
    fn load() -> Compose {
        let file = yaml(&docker().join("docker-compose.yml"));
        let services = file
            .get("services")
            .and_then(Yaml::as_mapping)
            .expect("docker-compose.yml has services");
        Compose {
            services: services
                .iter()
                .map(|(k, v)| (str_of(k, "service name").to_string(), v.clone()))
                .collect(),
        }
    }

    fn service(&self, name: &str) -> &Yaml {
        self.services
            .get(name)
            .unwrap_or_else(|| panic!("no compose service {name:?}"))
    }

    /// The one service whose image starts with `image`.
    fn by_image(&self, image: &str) -> (&str, &Yaml) {
        let found: Vec<_> = self
            .services
            .iter()
            .filter(|(_, s)| {
                s.get("image")
                    .and_then(Yaml::as_str)
                    .is_some_and(|i| i.starts_with(image))
            })
            .collect();
        assert_eq!(found.len(), 1, "services with image {image}*: {found:?}");
        (found[0].0.as_str(), found[0].1)
    }

    /// The bind mounts of a service, short (`./a:/b:ro`) or long syntax.
    fn mounts(&self, service: &str) -> Vec<Mount> {
        let Some(list) = self.service(service).get("volumes") else {
            return Vec::new();
        };
        let list = list.as_sequence().expect("volumes is a list");
        let mut out = Vec::new();
        for v in list {
            let (source, target) = match v {
                Yaml::String(s) => {
                    let mut parts = s.split(':');
                    let source = parts.next().unwrap_or("").to_string();
                    let target = parts
                        .next()
                        .unwrap_or_else(|| panic!("{service}: volume {s:?} has no target"))
                        .to_string();
                    (source, target)
                }
                Yaml::Mapping(_) => (
                    str_of(&v["source"], "volume source").to_string(),
                    str_of(&v["target"], "volume target").to_string(),
                ),
                other => panic!("{service}: volume {other:?}"),
            };
            // A named volume has a name, not a path.
            if source.starts_with('.') || source.starts_with('/') {
                out.push(Mount {
                    host: join_clean(&docker(), &source),
                    target,
                });
            }
        }
        out
    }

    /// Where on the host the container path `path` of `service` comes from, through
    /// its bind mounts (the longest mount target that contains it).
    fn host_path(&self, service: &str, path: &str) -> PathBuf {
        let mounts = self.mounts(service);
        let best = mounts
            .iter()
            .filter(|m| {
                path == m.target
                    || path.starts_with(&format!("{}/", m.target.trim_end_matches('/')))
            })
            .max_by_key(|m| m.target.len())
            .unwrap_or_else(|| {
                panic!("{service}: no bind mount holds {path} (mounts: {mounts:?})")
            });
        let rest = path[best.target.len()..].trim_start_matches('/');
        if rest.is_empty() {
            best.host.clone()
        } else {
            best.host.join(rest)
        }
    }

    /// The gateways: services whose /etc/sluice/rules.yaml (where the image reads
    /// its configuration) is the fleet configuration.
    fn gateways(&self) -> BTreeSet<String> {
        let fleet = docker().join("fleet/rules.yaml");
        self.services
            .keys()
            .filter(|s| {
                let holds = |m: &Mount| "/etc/sluice/rules.yaml".starts_with(&m.target);
                self.mounts(s).iter().any(holds)
                    && self.host_path(s, "/etc/sluice/rules.yaml") == fleet
            })
            .cloned()
            .collect()
    }

    /// `sluice ARGS` of the health checks that run the sluice binary, by service.
    fn sluice_health_checks(&self) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        for (name, s) in &self.services {
            let Some(test) = s.get("healthcheck").and_then(|h| h.get("test")) else {
                continue;
            };
            let words: Vec<String> = test
                .as_sequence()
                .unwrap_or_else(|| panic!("{name}: healthcheck.test as a list"))
                .iter()
                .map(|w| str_of(w, "healthcheck word").to_string())
                .collect();
            if words.get(1).map(String::as_str) == Some("/usr/local/bin/sluice") {
                assert_eq!(words[0], "CMD", "{name}: {words:?}");
                out.push((name.clone(), words[2..].to_vec()));
            }
        }
        out
    }
}

/// The published ports of a service, as (host address, host port, container port).
fn published(service: &Yaml) -> Vec<(String, u16, u16)> {
    let Some(ports) = service.get("ports") else {
        return Vec::new();
    };
    ports
        .as_sequence()
        .expect("ports is a list")
        .iter()
        .map(|p| {
            let s = str_of(p, "port");
            let parts: Vec<&str> = s.split(':').collect();
            let [address, host, container] = parts[..] else {
                panic!("port {s:?} as ADDRESS:HOST:CONTAINER");
            };
            (
                address.to_string(),
                host.parse().expect("host port"),
                container.parse().expect("container port"),
            )
        })
        .collect()
}

// === the Dockerfile ===

/// The sources of the Dockerfile's COPY and ADD lines from the build context (not
/// those `--from` another stage), relative to the context.
fn copy_sources(dockerfile: &str) -> Vec<String> {
    let joined = dockerfile.replace("\\\n", " ");
    let mut out = Vec::new();
    for line in joined.lines() {
        let line = line.trim();
        let mut words = line.split_whitespace();
        let Some(instruction) = words.next() else {
            continue;
        };
        if !instruction.eq_ignore_ascii_case("COPY") && !instruction.eq_ignore_ascii_case("ADD") {
            continue;
        }
        let args: Vec<&str> = words.collect();
        if args.iter().any(|a| a.starts_with("--from")) {
            continue;
        }
        let args: Vec<String> = if args.first().is_some_and(|a| a.starts_with('[')) {
            let list = line[instruction.len()..].trim();
            serde_json::from_str(list).unwrap_or_else(|e| panic!("{line}: {e}"))
        } else {
            args.iter()
                .filter(|a| !a.starts_with("--"))
                .map(|a| a.to_string())
                .collect()
        };
        assert!(args.len() >= 2, "{line}: no source");
        out.extend(args[..args.len() - 1].iter().cloned());
    }
    out
}

/// The command of the Dockerfile's `HEALTHCHECK ... CMD ["..."]`.
fn dockerfile_healthcheck(dockerfile: &str) -> Vec<String> {
    let joined = dockerfile.replace("\\\n", " ");
    let line = joined
        .lines()
        .find(|l| l.trim_start().starts_with("HEALTHCHECK"))
        .expect("a HEALTHCHECK");
    let (_, cmd) = line.split_once(" CMD ").expect("HEALTHCHECK ... CMD");
    serde_json::from_str(cmd.trim()).unwrap_or_else(|e| panic!("{line}: CMD as a JSON list: {e}"))
}

/// Files the crate reads while it compiles (`include_str!`, `include_bytes!`,
/// `#[path = ...]`) from `src/` and `examples/`, as paths from the repository root.
fn compile_time_reads() -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    for dir in ["src", "examples"] {
        for file in files_under(&root().join(dir)) {
            if file.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let text = read(&file);
            for marker in ["include_str!(\"", "include_bytes!(\"", "#[path = \""] {
                for (i, _) in text.match_indices(marker) {
                    let rest = &text[i + marker.len()..];
                    let named = &rest[..rest.find('"').expect("closing quote")];
                    let base = file.parent().expect("parent");
                    out.push((file.clone(), join_clean(base, named)));
                }
            }
        }
    }
    out
}

// === PromQL ===

/// Words of PromQL that are not metric names (aggregations, modifiers, operators,
/// literals); functions are recognised by the `(` that follows them.
const KEYWORDS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "atan2",
    "inf",
    "nan",
];

/// The keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names a PromQL expression (or a Grafana query) selects, in order:
/// every identifier that is not a keyword, a function, a label name (inside `{}`
/// or a `by (...)` list), a string, a duration, a number or a Grafana variable.
fn metric_names(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let n = chars.len();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    // The index just past the bracket that closes the one at `i`, strings skipped.
    let close = |i: usize, open: char, shut: char| -> usize {
        let mut depth = 0;
        let mut j = i;
        while j < n {
            match chars[j] {
                '"' | '\'' | '`' => j = skip_string(&chars, j) - 1,
                c if c == open => depth += 1,
                c if c == shut => {
                    depth -= 1;
                    if depth == 0 {
                        return j + 1;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        panic!("unclosed {open} in {expr:?}");
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i);
        } else if c == '{' {
            i = close(i, '{', '}');
        } else if c == '[' {
            i = close(i, '[', ']');
        } else if c == '#' {
            while i < n && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '$' {
            // $var, $__rate_interval, ${var}
            i += 1;
            if i < n && chars[i] == '{' {
                i = close(i, '{', '}');
            } else {
                while i < n && ident(chars[i]) {
                    i += 1;
                }
            }
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            // A number (0.99, 1e3, 0x1f) or a duration (5m, 1h30m).
            while i < n
                && (chars[i].is_ascii_alphanumeric()
                    || chars[i] == '.'
                    || ((chars[i] == '+' || chars[i] == '-') && matches!(chars[i - 1], 'e' | 'E')))
            {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < n && ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let lower = word.to_ascii_lowercase();
            let mut next = i;
            while next < n && chars[next].is_whitespace() {
                next += 1;
            }
            let paren = next < n && chars[next] == '(';
            if LABEL_LISTS.contains(&lower.as_str()) {
                if paren {
                    i = close(next, '(', ')');
                }
            } else if KEYWORDS.contains(&lower.as_str()) || paren {
                // a keyword, or a function called
            } else {
                out.push(word);
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The index just past the string that starts at `i` (its quote).
fn skip_string(chars: &[char], i: usize) -> usize {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() {
        if chars[j] == '\\' && quote != '`' {
            j += 2;
            continue;
        }
        if chars[j] == quote {
            return j + 1;
        }
        j += 1;
    }
    panic!("unclosed string in {:?}", chars.iter().collect::<String>());
}

/// A Grafana variable query as PromQL: `label_values(SELECTOR, LABEL)` is
/// `SELECTOR`, `label_values(LABEL)` selects no metric; anything else is PromQL.
fn grafana_query_promql(query: &str) -> String {
    let q = query.trim();
    match q
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(')'))
    {
        Some(inner) => match inner.rsplit_once(',') {
            Some((selector, _label)) => selector.to_string(),
            None => String::new(),
        },
        None => q.to_string(),
    }
}

/// What the alerts and the dashboard query, as (where, PromQL).
fn queries() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let alerts = yaml(&docker().join("prometheus/alerts.yml"));
    for group in alerts["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule
                .get("alert")
                .or_else(|| rule.get("record"))
                .map(|n| str_of(n, "rule name").to_string())
                .expect("a named rule");
            out.push((
                format!("alert {name}"),
                str_of(&rule["expr"], "expr").to_string(),
            ));
        }
    }
    for file in dashboards() {
        let dash = json(&file);
        for panel in all_panels(&dash) {
            let title = panel["title"].as_str().unwrap_or("?");
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"]
                    .as_str()
                    .unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
                out.push((format!("{} panel {title:?}", rel(&file)), expr.to_string()));
            }
        }
        for var in dash["templating"]["list"].as_array().into_iter().flatten() {
            if var["type"] != "query" {
                continue;
            }
            let q = match &var["query"] {
                Json::String(s) => s.clone(),
                other => other["query"].as_str().unwrap_or_default().to_string(),
            };
            out.push((
                format!("{} variable {}", rel(&file), var["name"]),
                grafana_query_promql(&q),
            ));
        }
    }
    out
}

/// The dashboards Grafana is given.
fn dashboards() -> Vec<PathBuf> {
    files_under(&docker().join("grafana/dashboards"))
        .into_iter()
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("json"))
        .collect()
}

/// Every panel of a dashboard, those inside rows included.
fn all_panels(dash: &Json) -> Vec<&Json> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// Every `datasource.uid` anywhere in `v`.
fn datasource_uids(v: &Json, out: &mut Vec<String>) {
    match v {
        Json::Object(map) => {
            for (k, child) in map {
                if k == "datasource" {
                    if let Some(uid) = child.get("uid").and_then(Json::as_str) {
                        out.push(uid.to_string());
                    }
                }
                datasource_uids(child, out);
            }
        }
        Json::Array(items) => items.iter().for_each(|i| datasource_uids(i, out)),
        _ => {}
    }
}

// === running things ===

fn promtool(args: &[&str]) -> Output {
    let mut cmd = Command::new("promtool");
    cmd.args(args).current_dir(docker().join("prometheus"));
    run_grouped(&mut cmd).unwrap_or_else(|e| {
        panic!("promtool: {e} (tests/run.sh installs Debian's prometheus package)")
    })
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `sluice ARGS` with exactly the `SLUICE_*`, `REDIS_URL`, `REDIS_TIMEOUT` and
/// `DEMO_UPSTREAM` variables of `env`.
fn sluice_cmd(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(SLUICE);
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("SLUICE_")
            || ["REDIS_URL", "REDIS_TIMEOUT", "DEMO_UPSTREAM"].contains(&k.as_str())
        {
            cmd.env_remove(k);
        }
    }
    cmd.env("SLUICE_LOG", "warn").envs(env.iter().copied());
    cmd
}

/// `sluice ARGS` to its end, on a blocking thread so this process' runtime goes on.
async fn sluice_output(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = sluice_cmd(args, env);
    let run = tokio::task::spawn_blocking(move || run_grouped(&mut cmd).expect("sluice runs"));
    bounded("sluice", run).await.expect("join")
}

/// `sluice run -c FILE` with `env`, up once `path` on its admin listener answers 200.
async fn sluice_process(
    file: &Path,
    env: &[(&str, &str)],
    admin: SocketAddr,
    path: &str,
) -> Spawned {
    let file = file.display().to_string();
    let mut cmd = sluice_cmd(&["run", "-c", &file], env);
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let child = spawn_grouped(&mut cmd).expect("start sluice");
    let probe = url(admin, path);
    let up = eventually(BOUND, || async {
        tokio::net::TcpStream::connect(admin).await.is_ok() && get(&probe, &[]).await.status == 200
    })
    .await;
    assert!(
        up.is_some(),
        "sluice -c {file} never answered {path} with 200"
    );
    child
}

/// The admin listener every `sluice health` check names, as the container asks it:
/// port 9091 of both fleet files (and of the image's default configuration), on
/// loopback. Named, so that a check never reads the configuration file to find it
/// (a file saved with a typo would turn a healthy instance unhealthy).
const CONTAINER_ADMIN: &str = "http://127.0.0.1:9091";

/// Every health check that runs sluice, by where it runs: the compose services'
/// and the image's own HEALTHCHECK (`upstream (image)`: the one service that keeps
/// it, on the upstream's configuration). Each is `sluice health --admin
/// CONTAINER_ADMIN`: liveness (/healthz), not /readyz, which answers 503 on every
/// instance at once while Redis is down.
fn health_checks() -> Vec<(String, Vec<String>)> {
    let compose = Compose::load();
    let mut checks = compose.sluice_health_checks();
    assert_eq!(
        checks.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(),
        ["sluice-1", "sluice-2", "upstream"]
    );
    let image = dockerfile_healthcheck(&read(&docker().join("Dockerfile")));
    assert_eq!(image[0], "/usr/local/bin/sluice", "{image:?}");
    checks.push(("upstream (image)".into(), image[1..].to_vec()));
    for (service, args) in &checks {
        assert_eq!(args, &["health", "--admin", CONTAINER_ADMIN], "{service}");
    }
    checks
}

/// A sluice running one of the fleet's files on loopback: the configuration its
/// container would have at /etc/sluice/rules.yaml, its environment, its admin
/// listener.
struct Live<'a> {
    config: PathBuf,
    env: &'a [(&'a str, &'a str)],
    admin: SocketAddr,
}

/// Runs every health check as its container does (SLUICE_CONFIG is the image's),
/// against the live process of its service, whose admin listener stands in for
/// `CONTAINER_ADMIN`; every one must pass.
async fn run_health_checks<'a>(
    checks: &[(String, Vec<String>)],
    live: &impl Fn(&str) -> &'a Live<'a>,
    when: &str,
) {
    for (service, args) in checks {
        let l = live(service);
        let admin = format!("http://{}", l.admin);
        let args: Vec<&str> = args
            .iter()
            .map(|a| {
                if a == CONTAINER_ADMIN {
                    admin.as_str()
                } else {
                    a.as_str()
                }
            })
            .collect();
        let config = l.config.display().to_string();
        let mut env = l.env.to_vec();
        env.push(("SLUICE_CONFIG", &config));
        let out = sluice_output(&args, &env).await;
        assert!(
            out.status.success(),
            "{when}: {service}: sluice {args:?}: {}",
            said(&out)
        );
    }
}

/// The ban entries of the deny list the request path enforces (GET /admin/deny).
async fn bans(admin: SocketAddr) -> Vec<Json> {
    let auth = format!("Bearer {TOKEN}");
    let r = get(
        &url(admin, "/admin/deny"),
        &[("authorization", auth.as_str())],
    )
    .await;
    assert_eq!(r.status, 200, "GET /admin/deny: {}", r.text());
    let all: Vec<Json> = serde_json::from_slice(&r.body).expect("a JSON array");
    all.into_iter().filter(|e| e["source"] == "ban").collect()
}

/// `promtool test rules` of alerts.yml on real scrapes of one gateway, one a
/// minute (as instance `sluice-1:9091`): the decisions and store errors it
/// exported. Redis answered the first three and was gone from the fourth on, so
/// SluiceStoreErrors is quiet until 2m, pending at 4m and firing from 5m on, with
/// the very alert alerts_test.yml expects of its synthetic outage (which has the
/// same shape).
fn promtool_on_scrapes(scrapes: &[String]) -> Output {
    let mut series: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for text in scrapes {
        for line in text.lines() {
            if !line.starts_with("sluice_requests_total{")
                && !line.starts_with("sluice_store_errors_total{")
            {
                continue;
            }
            let (selector, value) = line.rsplit_once(' ').expect("SERIES VALUE");
            let (name, labels) = selector.split_once('{').expect("NAME{LABELS}");
            let labels = labels.strip_suffix('}').expect("}");
            let series_name =
                format!("{name}{{job=\"sluice\",instance=\"sluice-1:9091\",{labels}}}");
            series
                .entry(series_name)
                .or_default()
                .push(value.to_string());
        }
    }
    assert!(series.len() > 10, "{series:?}");
    for (name, values) in &series {
        assert_eq!(values.len(), scrapes.len(), "{name}: {values:?}");
    }
    let expected = synthetic_outage_alert();
    let at = |minute: usize, alerts: &Json| {
        serde_json::json!({
            "eval_time": format!("{minute}m"),
            "alertname": "SluiceStoreErrors",
            "exp_alerts": alerts,
        })
    };
    let none = Json::Array(Vec::new());
    let test = serde_json::json!({
        "rule_files": [docker().join("prometheus/alerts.yml").display().to_string()],
        "evaluation_interval": "1m",
        "tests": [{
            "name": "real scrapes of a gateway that loses its Redis at 3m",
            "interval": "1m",
            "input_series": series
                .iter()
                .map(|(s, v)| serde_json::json!({"series": s, "values": v.join(" ")}))
                .collect::<Vec<_>>(),
            "alert_rule_test": [
                at(2, &none),
                at(4, &none),
                at(5, &expected),
                at(scrapes.len() - 1, &expected),
            ],
        }],
    });
    let file = tempfile::Builder::new()
        .suffix(".yml")
        .tempfile()
        .expect("temp");
    std::fs::write(file.path(), serde_yaml::to_string(&test).expect("YAML")).expect("write");
    promtool(&["test", "rules", &file.path().display().to_string()])
}

/// What alerts_test.yml expects of SluiceStoreErrors at the end of its synthetic
/// outage (Redis lost at 3m by sluice-1:9091, under traffic).
fn synthetic_outage_alert() -> Json {
    let tests = yaml(&docker().join("prometheus/alerts_test.yml"));
    let outage = tests["tests"]
        .as_sequence()
        .expect("tests")
        .iter()
        .find(|t| {
            t["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("a Redis outage under traffic"))
        })
        .expect("alerts_test.yml: the test of a Redis outage under traffic");
    let last = outage["alert_rule_test"]
        .as_sequence()
        .and_then(|a| a.last())
        .expect("an alert_rule_test");
    assert_eq!(last["alertname"].as_str(), Some("SluiceStoreErrors"));
    let alerts = serde_json::to_value(&last["exp_alerts"]).expect("as JSON");
    assert_eq!(
        alerts[0]["exp_labels"]["instance"], "sluice-1:9091",
        "{alerts}"
    );
    alerts
}

// === the tests ===

#[test]
fn every_yaml_and_json_file_parses() {
    let mut parsed = Vec::new();
    for file in files_under(&docker()) {
        match file.extension().and_then(|e| e.to_str()) {
            Some("yml" | "yaml") => {
                assert!(yaml(&file).is_mapping(), "{}: not a mapping", rel(&file));
            }
            Some("json") => {
                assert!(json(&file).is_object(), "{}: not an object", rel(&file));
            }
            _ => continue,
        }
        parsed.push(rel(&file));
    }
    assert_eq!(
        parsed,
        [
            "docker/docker-compose.yml",
            "docker/fleet/rules.yaml",
            "docker/fleet/upstream.yaml",
            "docker/grafana/dashboards/sluice.json",
            "docker/grafana/provisioning/dashboards/sluice.yml",
            "docker/grafana/provisioning/datasources/prometheus.yml",
            "docker/prometheus/alerts.yml",
            "docker/prometheus/alerts_test.yml",
            "docker/prometheus/prometheus.yml",
        ]
    );
}

#[test]
fn every_path_the_files_name_exists() {
    let compose = Compose::load();

    // Build contexts and Dockerfiles; every COPY source in the context.
    let mut dockerfiles = BTreeSet::new();
    for (name, s) in &compose.services {
        let Some(build) = s.get("build") else {
            continue;
        };
        let (context, dockerfile) = match build {
            Yaml::String(c) => (c.as_str(), "Dockerfile"),
            b => (
                str_of(&b["context"], "build.context"),
                b.get("dockerfile")
                    .map(|d| str_of(d, "build.dockerfile"))
                    .unwrap_or("Dockerfile"),
            ),
        };
        let context = join_clean(&docker(), context);
        assert!(
            context.is_dir(),
            "{name}: build context {} is not a directory",
            context.display()
        );
        let file = join_clean(&context, dockerfile);
        assert!(file.is_file(), "{name}: no Dockerfile {}", file.display());
        dockerfiles.insert((context, file));
    }
    assert!(!dockerfiles.is_empty(), "no service is built");
    for (context, file) in &dockerfiles {
        let text = read(file);
        let sources = copy_sources(&text);
        assert!(!sources.is_empty(), "{}: no COPY", rel(file));
        for src in &sources {
            let p = join_clean(context, src);
            assert!(
                p.exists(),
                "{}: COPY {src}: {} does not exist",
                rel(file),
                p.display()
            );
        }
        // What the build compiles reads only files the build stage copied.
        for (from, read) in compile_time_reads() {
            let copied = sources
                .iter()
                .any(|s| read.starts_with(join_clean(context, s)));
            assert!(
                copied,
                "{} reads {} while compiling, which {} does not COPY",
                rel(&from),
                rel(&read),
                rel(file)
            );
        }
        let check = dockerfile_healthcheck(&text);
        assert_eq!(
            check[..2],
            ["/usr/local/bin/sluice", "health"],
            "{}",
            rel(file)
        );
    }

    // Bind mounts; depends_on names services.
    for name in compose.services.keys() {
        for m in compose.mounts(name) {
            assert!(
                m.host.exists(),
                "{name}: mounts {} at {}, which does not exist",
                m.host.display(),
                m.target
            );
        }
        if let Some(deps) = compose.service(name).get("depends_on") {
            let deps: Vec<&Yaml> = match deps {
                Yaml::Mapping(m) => m.keys().collect(),
                Yaml::Sequence(s) => s.iter().collect(),
                other => panic!("{name}: depends_on {other:?}"),
            };
            for d in deps {
                let d = str_of(d, "depends_on");
                assert!(
                    compose.services.contains_key(d),
                    "{name} depends on {d:?}, no such service"
                );
            }
        }
    }
    // The gateways run the fleet configuration, mounted where the image reads it.
    let gateways = compose.gateways();
    assert_eq!(
        gateways,
        BTreeSet::from(["sluice-1".into(), "sluice-2".into()])
    );
    for g in &gateways {
        assert_eq!(
            compose.host_path(g, "/etc/sluice/rules.yaml"),
            docker().join("fleet/rules.yaml")
        );
    }
    assert_eq!(
        compose.host_path("upstream", "/etc/sluice/rules.yaml"),
        docker().join("fleet/upstream.yaml")
    );

    // Prometheus: its configuration and rule files, as the container sees them.
    let (prom, prom_service) = compose.by_image("prom/prometheus");
    let config_arg = prom_service["command"]
        .as_sequence()
        .expect("prometheus command as a list")
        .iter()
        .find_map(|a| a.as_str()?.strip_prefix("--config.file="))
        .expect("--config.file");
    let config_host = compose.host_path(prom, config_arg);
    assert_eq!(config_host, docker().join("prometheus/prometheus.yml"));
    let config = yaml(&config_host);
    let config_dir = Path::new(config_arg).parent().expect("config dir");
    let rule_files = config["rule_files"].as_sequence().expect("rule_files");
    assert!(!rule_files.is_empty());
    for r in rule_files {
        let in_container = config_dir.join(str_of(r, "rule file"));
        let host = compose.host_path(prom, &in_container.display().to_string());
        assert!(
            host.is_file(),
            "rule file {} is {}, which does not exist",
            in_container.display(),
            host.display()
        );
    }
    // Every gateway is scraped, and nothing else.
    let mut scraped = BTreeSet::new();
    for job in config["scrape_configs"]
        .as_sequence()
        .expect("scrape_configs")
    {
        for sc in job["static_configs"].as_sequence().expect("static_configs") {
            for t in sc["targets"].as_sequence().expect("targets") {
                let (host, _port) = str_of(t, "target").split_once(':').expect("HOST:PORT");
                scraped.insert(host.to_string());
            }
        }
    }
    assert_eq!(
        scraped, gateways,
        "Prometheus scrapes these, the gateways are those"
    );

    // Grafana: provisioning, the dashboards' directory, the home dashboard, and the
    // datasource every panel names.
    let (grafana, grafana_service) = compose.by_image("grafana/grafana");
    let provisioning = compose.host_path(grafana, "/etc/grafana/provisioning");
    assert_eq!(provisioning, docker().join("grafana/provisioning"));
    let mut uids = BTreeSet::new();
    for file in files_under(&provisioning.join("datasources")) {
        for ds in yaml(&file)["datasources"]
            .as_sequence()
            .expect("datasources")
        {
            uids.insert(str_of(&ds["uid"], "datasource uid").to_string());
            let url = str_of(&ds["url"], "datasource url");
            let host = url
                .strip_prefix("http://")
                .and_then(|r| r.split(':').next())
                .expect("http://HOST:PORT");
            assert_eq!(host, prom, "the datasource is not the Prometheus service");
        }
    }
    assert!(!uids.is_empty(), "no datasource provisioned");
    let mut provided = BTreeSet::new();
    let providers = files_under(&provisioning.join("dashboards"));
    assert!(!providers.is_empty(), "no dashboard provider");
    for file in providers {
        for p in yaml(&file)["providers"].as_sequence().expect("providers") {
            let path = str_of(&p["options"]["path"], "provider path");
            let host = compose.host_path(grafana, path);
            assert!(
                host.is_dir(),
                "dashboards at {path} are {}, not a directory",
                host.display()
            );
            provided.extend(files_under(&host));
        }
    }
    assert_eq!(provided.into_iter().collect::<Vec<_>>(), dashboards());
    let home = grafana_service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
        .as_str()
        .expect("a home dashboard");
    assert!(
        compose.host_path(grafana, home).is_file(),
        "home dashboard {home}"
    );
    for file in dashboards() {
        let mut used = Vec::new();
        datasource_uids(&json(&file), &mut used);
        assert!(!used.is_empty(), "{}: names no datasource", rel(&file));
        for uid in used {
            assert!(
                uids.contains(&uid),
                "{}: datasource uid {uid:?} is not provisioned ({uids:?})",
                rel(&file)
            );
        }
    }
}

#[test]
fn promtool_checks_the_configuration_and_tests_the_alerts() {
    for args in [
        &["check", "config", "prometheus.yml"][..],
        &["check", "rules", "alerts.yml"],
        &["test", "rules", "alerts_test.yml"],
    ] {
        let out = promtool(args);
        assert!(
            out.status.success(),
            "promtool {}:\n{}",
            args.join(" "),
            said(&out)
        );
    }
    // Every alert has a test that expects it to fire.
    let tests = yaml(&docker().join("prometheus/alerts_test.yml"));
    let mut fired = BTreeSet::new();
    for t in tests["tests"].as_sequence().expect("tests") {
        for a in t["alert_rule_test"].as_sequence().into_iter().flatten() {
            let expected = a["exp_alerts"].as_sequence().map_or(0, Vec::len);
            if expected > 0 {
                fired.insert(str_of(&a["alertname"], "alertname").to_string());
            }
        }
    }
    let alerts: BTreeSet<String> = queries()
        .iter()
        .filter_map(|(w, _)| w.strip_prefix("alert ").map(String::from))
        .collect();
    assert_eq!(
        fired, alerts,
        "alerts a test expects to fire, and the alerts"
    );

    // The dashboard's queries are PromQL too: promtool checks them as recording
    // rules, with Grafana's variables replaced by what they stand for.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, q)) in queries()
        .iter()
        .filter(|(w, _)| !w.starts_with("alert "))
        .enumerate()
    {
        if q.is_empty() {
            continue;
        }
        let q = q
            .replace("$__rate_interval", "20s")
            .replace("$__range", "15m")
            .replace("$instance", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&q).expect("quoted")
        ));
    }
    let file = tempfile::Builder::new()
        .suffix(".yml")
        .tempfile()
        .expect("temp");
    std::fs::write(file.path(), &rules).expect("write");
    let out = promtool(&["check", "rules", &file.path().display().to_string()]);
    assert!(
        out.status.success(),
        "dashboard queries:\n{}\n{rules}",
        said(&out)
    );
}

#[test]
fn metric_names_are_read_out_of_promql() {
    assert_eq!(
        metric_names(
            r#"sum by (route, decision) (rate(sluice_requests_total{instance=~"$instance", decision=~"limited|denied"}[$__rate_interval])) > 0"#
        ),
        ["sluice_requests_total"]
    );
    assert_eq!(
        metric_names(
            "histogram_quantile(0.99, sum by (le) (rate(sluice_request_duration_seconds_bucket{route=\"a}b\"}[5m] offset 1h)))"
        ),
        ["sluice_request_duration_seconds_bucket"]
    );
    assert_eq!(
        metric_names("up{job=\"sluice\"} == 0 and on(instance) group_left(version) sluice_build_info > bool 1e3"),
        ["up", "sluice_build_info"]
    );
    assert_eq!(
        metric_names(&grafana_query_promql(
            "label_values(sluice_build_info, instance)"
        )),
        ["sluice_build_info"]
    );
    assert!(metric_names(&grafana_query_promql("label_values(instance)")).is_empty());
    // A misspelt or foreign name is a name too: the check below refuses it.
    assert_eq!(
        metric_names("rate(sluice_requets_total[5m]) / rate(http_requests_total[5m])"),
        ["sluice_requets_total", "http_requests_total"]
    );
}

/// The fleet's own files on loopback: the demo upstream, a gateway on a real Redis
/// in front of it, a little traffic through every kind of decision, and then every
/// metric name the alerts and the dashboard use must be one its /metrics exports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_alerts_and_the_dashboard_use_only_exported_metrics() {
    let redis = RedisServer::start();
    let (up_port, up_admin) = (free_port(), free_port());
    let up_listen = format!("127.0.0.1:{up_port}");
    let up_admin_listen = format!("127.0.0.1:{up_admin}");
    let up_env = [
        ("SLUICE_LISTEN", up_listen.as_str()),
        ("SLUICE_ADMIN_LISTEN", up_admin_listen.as_str()),
    ];
    let upstream_file = docker().join("fleet/upstream.yaml");
    let _upstream = sluice_process(
        &upstream_file,
        &up_env,
        ([127, 0, 0, 1], up_admin).into(),
        "/healthz",
    )
    .await;

    let (port, admin_port) = (free_port(), free_port());
    let listen = format!("127.0.0.1:{port}");
    let admin_listen = format!("127.0.0.1:{admin_port}");
    let demo = format!("http://{up_listen}");
    let redis_url = redis.url();
    let env = [
        ("SLUICE_LISTEN", listen.as_str()),
        ("SLUICE_ADMIN_LISTEN", admin_listen.as_str()),
        ("SLUICE_ADMIN_TOKEN", TOKEN),
        ("REDIS_URL", redis_url.as_str()),
        ("DEMO_UPSTREAM", demo.as_str()),
        // Every decision exact even on a machine busy with other tests: no store
        // call may time out into `on_error`.
        ("REDIS_TIMEOUT", "5s"),
    ];
    // The gateway runs a copy of the fleet file in a directory of its own, as the
    // containers run it (mounted with its directory): saving a typo into it below
    // is what docs/redis-and-fleets.md's "try SluiceReloadFailed" does.
    let fleet_dir = tempfile::tempdir().expect("temp dir");
    let fleet_file = fleet_dir.path().join("rules.yaml");
    std::fs::copy(docker().join("fleet/rules.yaml"), &fleet_file).expect("copy");
    let admin: SocketAddr = ([127, 0, 0, 1], admin_port).into();
    let _gateway = sluice_process(&fleet_file, &env, admin, "/readyz").await;

    // The compose health checks and the image's own HEALTHCHECK, run as the
    // containers run them, pass against these.
    let checks = health_checks();
    let gateway = Live {
        config: fleet_file.clone(),
        env: &env,
        admin,
    };
    let upstream = Live {
        config: upstream_file.clone(),
        env: &up_env,
        admin: ([127, 0, 0, 1], up_admin).into(),
    };
    let live = |service: &str| {
        if service.starts_with("upstream") {
            &upstream
        } else {
            &gateway
        }
    };
    run_health_checks(&checks, &live, "the gateways running").await;

    // Traffic: allowed and limited, denied, banned, delayed, forwarded.
    let at = |path: &str| url(([127, 0, 0, 1], port).into(), path);
    // /hello is a fixed window of 10 s: six requests must not straddle two.
    let window = std::time::Duration::from_secs(10);
    let into = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        % window.as_millis();
    if into > 7_000 {
        at_window_start(window).await;
    }
    let mut hello = Vec::new();
    for _ in 0..6 {
        hello.push(get(&at("/hello"), &[]).await);
    }
    assert_eq!(hello[0].text(), "hello from the demo upstream\n");
    assert_eq!(
        hello.iter().map(|r| r.status).collect::<Vec<_>>(),
        ok_then_limited(5, 1)
    );
    let leaked = get(&at("/api/items"), &[("x-api-key", "leaked-key-123")]).await;
    assert_eq!(leaked.status, 403);
    let mut login = Vec::new();
    for _ in 0..8 {
        login.push(get(&at("/login"), &[("x-user", "mallory")]).await.status);
    }
    assert_eq!(login, [200, 200, 200, 429, 429, 429, 429, 429]);
    // The fifth refusal asks the control loop for the ban, which the request path
    // enforces a moment later: once GET /admin/deny (the list the request path
    // enforces) holds it, the next attempt is denied.
    let banned = eventually(BOUND, || async { !bans(admin).await.is_empty() }).await;
    assert!(banned.is_some(), "no ban within {BOUND:?}");
    let ninth = get(&at("/login"), &[("x-user", "mallory")]).await;
    assert_eq!(ninth.status, 403);
    let bans = bans(admin).await;
    assert_eq!(bans.len(), 1, "{bans:?}");
    assert_eq!(
        (&bans[0]["kind"], &bans[0]["value"], &bans[0]["route"]),
        (
            &Json::from("key"),
            &Json::from("mallory"),
            &Json::from("login")
        ),
        "{bans:?}"
    );
    let other = get(&at("/anything"), &[]).await;
    assert_eq!(
        (other.status, other.text()),
        (200, "{\"upstream\": \"demo\", \"ok\": true}\n")
    );

    let text = metrics(admin).await;
    for (series, value) in [
        (
            "sluice_requests_total{decision=\"allowed\",route=\"hello\"}",
            5.0,
        ),
        (
            "sluice_requests_total{decision=\"limited\",route=\"hello\"}",
            1.0,
        ),
        (
            "sluice_requests_total{decision=\"denied\",route=\"api\"}",
            1.0,
        ),
        (
            "sluice_requests_total{decision=\"allowed\",route=\"login\"}",
            3.0,
        ),
        (
            "sluice_requests_total{decision=\"limited\",route=\"login\"}",
            5.0,
        ),
        (
            "sluice_requests_total{decision=\"denied\",route=\"login\"}",
            1.0,
        ),
        (
            "sluice_requests_total{decision=\"allowed\",route=\"everything\"}",
            1.0,
        ),
        ("sluice_bans_total{route=\"login\"}", 1.0),
        ("sluice_store_errors_total{store=\"redis\"}", 0.0),
        ("sluice_config_last_reload_success", 1.0),
    ] {
        assert_eq!(metric(&text, series), Some(value), "{series}\n{text}");
    }

    // The families /metrics exports; a histogram's series are NAME_bucket, _sum
    // and _count.
    let mut exported = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').expect("# TYPE NAME KIND");
        exported.insert(name.to_string());
        if kind == "histogram" || kind == "summary" {
            for suffix in ["_bucket", "_sum", "_count"] {
                exported.insert(format!("{name}{suffix}"));
            }
        }
    }
    assert!(exported.contains("sluice_requests_total"), "{exported:?}");

    let mut unknown = Vec::new();
    let mut used = BTreeSet::new();
    let queries = queries();
    assert!(queries.len() >= 10, "{queries:?}");
    for (place, q) in &queries {
        for name in metric_names(q) {
            // `up` is Prometheus' own, one per scrape target.
            let known = if name.starts_with("sluice_") {
                exported.contains(&name)
            } else {
                name == "up"
            };
            if !known {
                unknown.push(format!("{place}: {name}"));
            }
            used.insert(name);
        }
    }
    assert!(
        unknown.is_empty(),
        "metric names sluice does not export:\n{}",
        unknown.join("\n")
    );
    // The issue's list: decisions, refusals, both latencies, store errors, deny
    // entries and bans, reloads, instances.
    for name in [
        "sluice_requests_total",
        "sluice_request_duration_seconds_bucket",
        "sluice_limiter_duration_seconds_bucket",
        "sluice_store_errors_total",
        "sluice_deny_entries",
        "sluice_bans_total",
        "sluice_config_last_reload_success",
        "up",
    ] {
        assert!(used.contains(name), "nothing queries {name}");
    }
    // The store panel shows both faces of an outage, as SluiceStoreErrors reads
    // them: failed calls, and the requests decided by on_error (which alone keep
    // counting once the breaker is open).
    let store_panel: Vec<&str> = queries
        .iter()
        .filter(|(w, _)| w.ends_with("panel \"Store errors\""))
        .map(|(_, q)| q.as_str())
        .collect();
    assert_eq!(store_panel.len(), 2, "{store_panel:?}");
    assert!(
        store_panel[0].contains("sluice_store_errors_total"),
        "{store_panel:?}"
    );
    assert!(
        store_panel[1].contains("sluice_requests_total")
            && store_panel[1].contains("decision=~\"store_error_allowed|store_error_denied\""),
        "{store_panel:?}"
    );

    // === Redis goes away ===
    // Nine "minutes", one scrape each after 3 requests to /api/items (every one
    // with a key of its own, so none is limited): Redis answers for the first
    // three and is gone from the fourth on. The scrapes are then the input of a
    // promtool test: SluiceStoreErrors must fire on what sluice really exports.
    let mut redis = redis;
    let mut scrapes = Vec::new();
    let mut sent = 0;
    for minute in 0..9 {
        if minute == 3 {
            redis.kill();
            let readyz = url(admin, "/readyz");
            let down = eventually(BOUND, || async { get(&readyz, &[]).await.status == 503 }).await;
            assert!(down.is_some(), "/readyz never answered 503 without Redis");
            // Idle, the breaker open: nothing is counted, neither store errors
            // (the probes that failed are not calls) nor decisions.
            let text = metrics(admin).await;
            assert_eq!(
                metric(&text, "sluice_store_errors_total{store=\"redis\"}"),
                Some(0.0)
            );
            for route in ["hello", "api", "login", "search", "everything"] {
                for decision in ["store_error_allowed", "store_error_denied"] {
                    assert_eq!(requests(&text, route, decision), 0.0, "{route} {decision}");
                }
            }
            // The health checks are liveness: with on_error local, an instance
            // without Redis still serves (and /readyz, 503, is for alerts).
            run_health_checks(&checks, &live, "Redis down").await;
        }
        for _ in 0..3 {
            sent += 1;
            let key = format!("outage-{sent}");
            let r = get(&at("/api/items"), &[("x-api-key", key.as_str())]).await;
            assert_eq!(r.status, 200, "request {sent}");
        }
        scrapes.push(metrics(admin).await);
    }
    let last = scrapes.last().expect("scrapes");
    // The breaker opened before the first request: requests were decided by
    // on_error (local) without calling Redis, and not one counts as a store error.
    for (series, value) in [
        ("sluice_store_errors_total{store=\"redis\"}", 0.0),
        (
            "sluice_requests_total{decision=\"allowed\",route=\"api\"}",
            9.0,
        ),
        (
            "sluice_requests_total{decision=\"store_error_allowed\",route=\"api\"}",
            18.0,
        ),
        (
            "sluice_requests_total{decision=\"store_error_denied\",route=\"api\"}",
            0.0,
        ),
    ] {
        assert_eq!(metric(last, series), Some(value), "{series}\n{last}");
    }
    let out = promtool_on_scrapes(&scrapes);
    assert!(
        out.status.success(),
        "SluiceStoreErrors on the real series:\n{}",
        said(&out)
    );

    // === A typo saved into the configuration ===
    // The reload is refused (SluiceReloadFailed) and the instance goes on with the
    // configuration it has: its health checks, which name the admin listener and
    // so need nothing from the file, still pass, with the image's too on a broken
    // upstream file.
    let text = read(&fleet_file).replace("sliding_window", "sliding_windw");
    assert!(
        text.contains("sliding_windw"),
        "the fleet's rules have no typo to make"
    );
    std::fs::write(&fleet_file, text).expect("write the typo");
    let failed = eventually(BOUND, || async {
        metric(&metrics(admin).await, "sluice_config_last_reload_success") == Some(0.0)
    })
    .await;
    assert!(failed.is_some(), "the typo was not refused by a reload");
    let broken_upstream = fleet_dir.path().join("upstream.yaml");
    std::fs::write(
        &broken_upstream,
        read(&upstream_file).replace("respond:", "repsond:"),
    )
    .expect("write");
    for file in [&fleet_file, &broken_upstream] {
        let out = sluice_output(&["check", "-c", &file.display().to_string()], &env).await;
        assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    }
    let upstream = Live {
        config: broken_upstream,
        ..upstream
    };
    let live = |service: &str| {
        if service.starts_with("upstream") {
            &upstream
        } else {
            &gateway
        }
    };
    run_health_checks(&checks, &live, "a typo in the configuration files").await;
}

/// `sluice check` accepts both fleet files with the compose file's environment (the
/// token set, nothing else), on the ports the compose file and Prometheus use; the
/// gateway's refuses to start without the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_configuration_passes_sluice_check() {
    let fleet = docker().join("fleet/rules.yaml").display().to_string();
    let out = sluice_output(&["check", "-c", &fleet], &[("SLUICE_ADMIN_TOKEN", TOKEN)]).await;
    let summary = said(&out);
    assert!(out.status.success(), "{summary}");
    let line = |prefix: &str| -> String {
        summary
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in\n{summary}"))
            .to_string()
    };
    assert_eq!(
        line("listen"),
        "listen  0.0.0.0:8080 (http/1.1, h2c)   admin 0.0.0.0:9091 (token)"
    );
    assert_eq!(
        line("store"),
        "store   redis redis://redis:6379/0, timeout 50ms, key_prefix \"sluice:\", on_error local (local: memory, max_keys 1000000)"
    );
    assert_eq!(
        line("upstream"),
        "upstream demo -> http://upstream:8080 (connect 2s, timeout 10s)"
    );

    // What the compose file publishes and Prometheus scrapes are those ports.
    let compose = Compose::load();
    for g in compose.gateways() {
        let container: BTreeSet<u16> = published(compose.service(&g)).iter().map(|p| p.2).collect();
        assert_eq!(container, BTreeSet::from([8080, 9091]), "{g} publishes");
        assert_eq!(
            compose.service(&g)["environment"]["SLUICE_ADMIN_TOKEN"].as_str(),
            Some("${SLUICE_ADMIN_TOKEN:-change-me}")
        );
        // Their health checks are liveness, so the start order comes from here:
        // Redis and the upstream healthy first.
        let deps = &compose.service(&g)["depends_on"];
        for d in ["redis", "upstream"] {
            assert_eq!(
                deps[d]["condition"].as_str(),
                Some("service_healthy"),
                "{g} depends on {d}"
            );
        }
    }
    // The ports docs/redis-and-fleets.md gives, on loopback only (the token
    // defaults to change-me, and Grafana lets anyone look).
    let mut ports = BTreeMap::new();
    for (name, s) in &compose.services {
        for (address, host, container) in published(s) {
            assert_eq!(
                address, "127.0.0.1",
                "{name} publishes {host} beyond loopback"
            );
            ports.insert(host, (name.as_str(), container));
        }
    }
    assert_eq!(
        ports,
        BTreeMap::from([
            (3000, ("grafana", 3000)),
            (8080, ("sluice-1", 8080)),
            (8081, ("sluice-2", 8080)),
            (9090, ("prometheus", 9090)),
            (9091, ("sluice-1", 9091)),
            (9092, ("sluice-2", 9091)),
        ])
    );
    let prom = yaml(&docker().join("prometheus/prometheus.yml"));
    for job in prom["scrape_configs"].as_sequence().expect("jobs") {
        for sc in job["static_configs"].as_sequence().expect("static_configs") {
            for t in sc["targets"].as_sequence().expect("targets") {
                assert!(
                    str_of(t, "target").ends_with(":9091"),
                    "{t:?} is not the admin port"
                );
            }
        }
    }

    let out = sluice_output(&["check", "-c", &fleet], &[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    assert!(
        said(&out).contains("environment variable SLUICE_ADMIN_TOKEN is not set"),
        "{}",
        said(&out)
    );

    let upstream = docker().join("fleet/upstream.yaml").display().to_string();
    let out = sluice_output(&["check", "-c", &upstream], &[]).await;
    assert!(out.status.success(), "{}", said(&out));
    // Its admin listener is where its health checks ask, CONTAINER_ADMIN (the
    // gateways' is 0.0.0.0:9091, above, which 127.0.0.1 reaches too).
    assert!(
        said(&out).contains("   admin 127.0.0.1:9091 (no token)\n"),
        "{}",
        said(&out)
    );
}
