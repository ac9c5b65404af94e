//! `sluice check` through the library: every rule of the configuration file is
//! reported as `FILE:LINE:COL: message` at the node that causes it, and a valid file
//! loads. Each case writes its YAML to a temporary `rules.yaml` and loads it.

use std::path::{Path, PathBuf};

use sluice::config::summary::summary;
use sluice::config::{load, Loaded};

/// Every error from loading `yaml` as `rules.yaml`, as printed (the temporary
/// directory left out of the file name).
fn errors(yaml: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    errors_in(dir.path(), yaml)
}

fn errors_in(dir: &Path, yaml: &str) -> Vec<String> {
    let path = dir.join("rules.yaml");
    std::fs::write(&path, yaml).unwrap();
    match load(&path) {
        Ok(_) => Vec::new(),
        Err(errs) => errs
            .0
            .iter()
            .map(|e| {
                assert_eq!(e.file, path);
                let shown = e.to_string();
                let prefix = format!("{}/", dir.display());
                shown.strip_prefix(&prefix).unwrap_or(&shown).to_string()
            })
            .collect(),
    }
}

/// The single error from loading `yaml`.
#[track_caller]
fn error(yaml: &str) -> String {
    let errs = errors(yaml);
    assert_eq!(errs.len(), 1, "expected one error, got {errs:#?}");
    errs.into_iter().next().unwrap()
}

#[track_caller]
fn loads(yaml: &str) -> Loaded {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.yaml");
    std::fs::write(&path, yaml).unwrap();
    match load(&path) {
        Ok(loaded) => loaded,
        Err(e) => panic!("expected a clean load, got:\n{e}"),
    }
}

/// A route around one limit, written in block style at lines 6 and on:
/// `- algorithm:` on line 6 (mapping at column 9), each further field on its own
/// line with its key at column 9.
fn with_limit(limit_lines: &str) -> String {
    format!(
        "\
upstreams: {{api: {{targets: [http://127.0.0.1:3000]}}}}
routes:
  - name: a
    upstream: api
    limits:
{limit_lines}"
    )
}

// === serde: unknown fields, bad values, ${VAR} ===

#[test]
fn typo_in_server_is_located() {
    assert_eq!(
        error("server:\n  listen: 0.0.0.0:8080\n  max_conections: 5\nroutes: []\n"),
        "rules.yaml:3:3: server: unknown field `max_conections`, expected one of `listen`, \
         `request_header_timeout`, `max_request_body`, `max_key_body`, `shutdown_grace`, \
         `max_connections`, `max_connections_per_ip`, `idle_timeout`, `send_timeout`, `request_body_timeout`, \
         `request_buffer`, `max_buffered_bytes`, `tunnel_idle_timeout`, `max_header_bytes`, `upgrades`, `tls`, `workers`"
    );
}

#[test]
fn max_key_body_is_above_0_and_at_most_1mib() {
    assert_eq!(
        errors("server:\n  max_key_body: 0\nroutes: []\n"),
        ["rules.yaml:2:17: max_key_body must be greater than 0"]
    );
    assert_eq!(
        errors("server:\n  max_key_body: 2MiB\nroutes: []\n"),
        ["rules.yaml:2:17: max_key_body must be at most 1MiB, found 2097152 bytes"]
    );
    assert_eq!(
        loads("server:\n  max_key_body: 1MiB\nroutes: []\n")
            .file
            .server
            .max_key_body
            .0,
        1024 * 1024
    );
}

#[test]
fn max_buffered_bytes_holds_at_least_one_read_ahead() {
    assert_eq!(
        errors("server:\n  max_buffered_bytes: 32KiB\nroutes: []\n"),
        ["rules.yaml:2:23: max_buffered_bytes must be at least request_buffer (65536 bytes), so that one request can be read ahead, found 32768 bytes"]
    );
    let server = loads("server:\n  max_buffered_bytes: 1MiB\n  request_buffer: 1MiB\nroutes: []\n")
        .file
        .server;
    assert_eq!(
        (server.max_buffered_bytes.0, server.request_buffer.0),
        (1 << 20, 1 << 20)
    );
    assert_eq!(
        loads("routes: []\n").file.server.max_buffered_bytes.0,
        16 << 20
    );
}

#[test]
fn access_log_sample_is_a_share_and_its_format_one_of_two() {
    assert_eq!(
        errors("access_log:\n  sample: 1.5\nroutes: []\n"),
        ["rules.yaml:2:11: sample is the share of forwarded requests logged, from 0 to 1, found 1.5"]
    );
    let e = error("access_log: {format: apache}\nroutes: []\n");
    assert!(
        e.starts_with("rules.yaml:1:22: ") && e.contains("json") && e.contains("combined"),
        "{e}"
    );
    let on = loads("access_log: {}\nroutes: []\n")
        .file
        .access_log
        .unwrap();
    assert_eq!(
        (on.format, on.sample),
        (sluice::config::schema::AccessFormat::Json, 1.0)
    );
    assert!(loads("routes: []\n").file.access_log.is_none());
}

#[test]
fn an_access_log_file_is_in_a_directory_that_exists_and_buffered_only_with_a_path() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    assert_eq!(
        errors_in(
            dir.path(),
            &format!("access_log:\n  path: {d}/nowhere/access.log\nroutes: []\n")
        ),
        [format!(
            "rules.yaml:2:9: the directory of \"{d}/nowhere/access.log\" does not exist"
        )]
    );
    assert_eq!(
        errors_in(
            dir.path(),
            &format!("access_log:\n  path: {d}\nroutes: []\n")
        ),
        [format!("rules.yaml:2:9: \"{d}\" is a directory")]
    );
    assert_eq!(
        errors("access_log:\n  buffer: 4KiB\n  flush: 0s\nroutes: []\n"),
        [
            "rules.yaml:2:3: buffer applies only with path: on stderr each line is written at once",
            "rules.yaml:3:3: flush applies only with path: on stderr each line is written at once",
            "rules.yaml:3:10: flush must be greater than 0",
        ]
    );
    assert_eq!(
        errors_in(
            dir.path(),
            &format!("access_log: {{path: {d}/a.log, buffer: 32MiB}}\nroutes: []\n")
        ),
        [format!(
            "rules.yaml:1:{}: buffer must be at most 16MiB, found 33554432 bytes",
            format!("access_log: {{path: {d}/a.log, buffer: ").len() + 1
        )]
    );
    let loaded = loads("access_log: {path: access.log, buffer: 0, flush: 250ms}\nroutes: []\n");
    assert!(
        summary(&loaded).contains(
            "access  json to access.log (buffer 0, flush 250ms; reopened on SIGUSR1), 100% of forwarded requests, every refusal\n"
        ),
        "{}",
        summary(&loaded)
    );
    let on = loaded.file.access_log.unwrap();
    assert_eq!(
        (
            on.path.unwrap().as_str(),
            on.buffer.unwrap().0,
            on.flush.unwrap().get()
        ),
        ("access.log", 0, std::time::Duration::from_millis(250))
    );
}

#[test]
fn typo_in_store_is_located() {
    assert_eq!(
        error("store:\n  backend: memory\n  memroy: {max_keys: 5}\nroutes: []\n"),
        "rules.yaml:3:3: store: unknown field `memroy`, expected one of `backend`, `memory`, \
         `redis`, `on_error`"
    );
}

#[test]
fn typo_in_match_is_located() {
    let yaml = "\
routes:
  - name: a
    match: {path: /x, method: [GET]}
    respond: {status: 200}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:3:23: routes[0].match: unknown field `method`, expected one of `host`, \
         `path`, `path_prefix`, `path_regex`, `methods`, `headers`, `case_insensitive`"
    );
}

#[test]
fn typo_in_a_limit_is_located() {
    let yaml = with_limit("      - algorithm: gcra\n        rate: 10/s\n        brust: 20\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:8:9: routes[0].limits[0]: unknown field `brust`, expected one of `name`, \
         `algorithm`, `limit`, `window`, `rate`, `burst`, `cost`, `count`, `lease`, `shadow`, `key`, `normalize_key`, `reserve`"
    );
}

#[test]
fn bad_values_are_located_without_a_repeated_position() {
    assert_eq!(
        error("server: {listen: 'localhost'}\nroutes: []\n"),
        "rules.yaml:1:18: server.listen: expected a listen address like 0.0.0.0:8080 or \
         [::1]:9091, found \"localhost\""
    );
    let yaml =
        with_limit("      - algorithm: fixed_window\n        limit: 5\n        window: 1w\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:8:17: routes[0].limits[0].window: expected a duration like 10s, 1m, 1h or \
         1d, or month, found \"1w\""
    );
}

#[test]
fn syntax_errors_keep_their_context() {
    assert_eq!(
        error("routes: [\n"),
        "rules.yaml:2:1: did not find expected node content, while parsing a flow node"
    );
}

#[test]
fn unset_variable_is_located() {
    let yaml = with_limit("      - algorithm: gcra\n        rate: ${SLUICE_TEST_UNSET_RATE}\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:7:15: routes[0].limits[0].rate: environment variable \
         SLUICE_TEST_UNSET_RATE is not set (write ${SLUICE_TEST_UNSET_RATE:-default} for a \
         fallback)"
    );
    assert_eq!(
        error("admin: {listen: 0.0.0.0:9091, token: \"${SLUICE_TEST_UNSET_TOKEN}\"}\nroutes: []\n"),
        "rules.yaml:1:38: admin.token: environment variable SLUICE_TEST_UNSET_TOKEN is not set \
         (write ${SLUICE_TEST_UNSET_TOKEN:-default} for a fallback)"
    );
}

#[test]
fn unset_variable_in_a_key_is_located() {
    // `key` is a string or a list: serde would only say that neither matched.
    let yaml = "\
routes:
  - name: a
    respond: {}
    key: header:${SLUICE_TEST_UNSET_HEADER}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:10: routes[0].key: environment variable SLUICE_TEST_UNSET_HEADER is not \
         set (write ${SLUICE_TEST_UNSET_HEADER:-default} for a fallback)"
    );
    let yaml = "\
routes:
  - name: a
    respond: {}
    key: [ip, 'query:${SLUICE_TEST_UNSET_QUERY}']
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:15: routes[0].key[1]: environment variable SLUICE_TEST_UNSET_QUERY is not \
         set (write ${SLUICE_TEST_UNSET_QUERY:-default} for a fallback)"
    );
    assert_eq!(
        error("routes:\n  - name: a\n    respond: {}\n    key: {header: x}\n"),
        "rules.yaml:4:10: routes[0].key: expected a key (ip, global, header:NAME, query:NAME, \
         cookie:NAME, form:NAME, json:/POINTER, jwt:CLAIM or jwt:/POINTER) or a list of these, found a mapping"
    );
}

/// A value that takes one of several forms (`cost`, `key`) says which forms those
/// are when it is none of them, at the value, never serde's "data did not match
/// any variant of untagged enum".
#[test]
fn values_of_several_forms_say_which_forms_they_take() {
    let cost = |value: &str| {
        error(&with_limit(&format!(
            "      - algorithm: token_bucket\n        rate: 10/s\n        cost: {value}\n"
        )))
    };
    let forms = "expected a cost: a whole number of units (cost: 3), \
                 {response_header: NAME, default: N} or {response_json: POINTER, estimate: N, default: N}";
    assert_eq!(
        cost("lots"),
        format!("rules.yaml:8:15: routes[0].limits[0].cost: {forms}, found \"lots\"")
    );
    assert_eq!(
        cost("[1, 2]"),
        format!("rules.yaml:8:15: routes[0].limits[0].cost: {forms}, found a list")
    );
    assert_eq!(
        cost("-1"),
        format!("rules.yaml:8:15: routes[0].limits[0].cost: {forms}, found \"-1\"")
    );
    // A mapping is the response form: its own fields are named.
    assert_eq!(
        cost("{header: x-tokens}"),
        "rules.yaml:8:16: routes[0].limits[0].cost: unknown field `header`, expected \
         one of `response_header`, `response_json`, `estimate`, `default`"
    );
    assert_eq!(
        cost("${SLUICE_TEST_UNSET_COST}"),
        "rules.yaml:8:15: routes[0].limits[0].cost: environment variable \
         SLUICE_TEST_UNSET_COST is not set (write ${SLUICE_TEST_UNSET_COST:-default} for a \
         fallback)"
    );
    // A limit's key, like the route's.
    let yaml = with_limit(
        "      - algorithm: fixed_window\n        limit: 1\n        window: 1m\n        key: {cookie: sid}\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:9:14: routes[0].limits[0].key: expected a key (ip, global, header:NAME, \
         query:NAME, cookie:NAME, form:NAME, json:/POINTER, jwt:CLAIM or jwt:/POINTER) or a list of these, found a mapping"
    );
    let yaml = with_limit(
        "      - algorithm: fixed_window\n        limit: 1\n        window: 1m\n        key: [ip, [header:x]]\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:9:19: routes[0].limits[0].key[1]: expected a key part like ip or \
         header:NAME, found a list"
    );
    // Both forms still load.
    loads(&with_limit(
        "      - algorithm: token_bucket\n        rate: 10/s\n        cost: 2\n        key: [ip, \"header:x-k\"]\n",
    ));
    loads(&with_limit(
        "      - algorithm: token_bucket\n        rate: 10/s\n        cost: {response_header: x-t}\n        key: ip\n",
    ));
}

#[test]
fn variables_with_defaults_and_set_variables_are_used() {
    std::env::set_var("SLUICE_TEST_SET_PREFIX", "/set/");
    let yaml = "\
admin: {listen: 0.0.0.0:9091, token: '${SLUICE_TEST_UNSET_TOKEN2:-fallback}'}
routes:
  - name: a
    match: {path_prefix: '${SLUICE_TEST_SET_PREFIX}'}
    respond: {status: '${SLUICE_TEST_UNSET_STATUS:-204}'}
";
    let loaded = loads(yaml);
    assert_eq!(
        loaded.file.admin.token.as_ref().map(|t| t.as_str()),
        Some("fallback")
    );
    let route = &loaded.file.routes[0];
    assert_eq!(
        route.matcher.path_prefix.as_ref().map(|p| p.as_str()),
        Some("/set/")
    );
    assert_eq!(route.respond.as_ref().map(|r| r.status.get()), Some(204));
}

#[test]
fn missing_required_field_is_at_its_mapping() {
    assert_eq!(
        error("routes:\n  - respond: {}\n"),
        "rules.yaml:2:5: routes[0]: missing field `name`"
    );
}

// === routes ===

#[test]
fn route_names_are_unique() {
    let yaml = "\
routes:
  - name: a
    respond: {}
  - name: a
    respond: {}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:11: route name \"a\" is already used at line 2; route names must be unique"
    );
}

#[test]
fn route_name_is_not_empty_nor_reserved() {
    assert_eq!(
        error("routes:\n  - name: ''\n    respond: {}\n"),
        "rules.yaml:2:11: route name must not be empty"
    );
    assert_eq!(
        error("routes:\n  - name: unmatched\n    respond: {}\n"),
        "rules.yaml:2:11: route name \"unmatched\" is reserved: metrics use it for requests that \
         match no route"
    );
}

#[test]
fn route_needs_upstream_or_respond() {
    let yaml = "\
upstreams: {api: {targets: [http://127.0.0.1:3000]}}
routes:
  - name: a
    match: {path: /}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:3:5: route \"a\" needs upstream (forward to an upstream) or respond (answer \
         directly)"
    );
}

#[test]
fn route_takes_only_one_of_upstream_and_respond() {
    let yaml = "\
upstreams: {api: {targets: [http://127.0.0.1:3000]}}
routes:
  - name: a
    upstream: api
    respond: {status: 200}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:5:5: route \"a\" has both upstream and respond; give exactly one"
    );
}

#[test]
fn upstream_must_exist() {
    let yaml = "\
upstreams:
  api: {targets: [http://127.0.0.1:3000]}
  web: {targets: [http://127.0.0.1:3001]}
routes:
  - name: a
    upstream: apl
";
    assert_eq!(
        error(yaml),
        "rules.yaml:6:15: unknown upstream \"apl\", expected one of: api, web"
    );
    assert_eq!(
        error("routes:\n  - name: a\n    upstream: api\n"),
        "rules.yaml:3:15: unknown upstream \"api\", no upstreams are defined"
    );
}

#[test]
fn respond_route_may_have_limits() {
    let yaml = "\
routes:
  - name: teapot
    respond: {status: 418, body: short and stout}
    limits: [{algorithm: fixed_window, limit: 1, window: 1s}]
";
    loads(yaml);
}

/// A 1xx is no answer: hyper would send a bare 500 (or a 101 and close) instead.
#[test]
fn respond_status_is_a_final_status() {
    let yaml = "\
routes:
  - {name: a, respond: {status: 100}}
  - {name: b, respond: {status: 101}}
  - {name: c, respond: {status: 199}}
  - {name: d, respond: {status: 200}}
  - {name: e, respond: {status: 599}}
  - {name: f, respond: {status: 600}}
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:2:33: respond.status must be between 200 and 599, found 100",
            "rules.yaml:3:33: respond.status must be between 200 and 599, found 101",
            "rules.yaml:4:33: respond.status must be between 200 and 599, found 199",
            "rules.yaml:7:33: respond.status must be between 200 and 599, found 600",
        ]
    );
}

/// A 204 or 304 has no body (RFC 9110 §15.3.5, §15.4.5): hyper would drop it, and a
/// HEAD answer would state its length. A body with either is refused at the body;
/// an empty one, or another status, loads.
#[test]
fn respond_with_204_or_304_has_no_body() {
    let yaml = "\
routes:
  - {name: a, respond: {status: 204, body: gone}}
  - {name: b, respond: {status: 304, body: \"x\"}}
  - {name: c, respond: {status: 204, body: \"\"}}
  - {name: d, respond: {status: 304}}
  - {name: e, respond: {status: 205, body: reset}}
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:2:44: respond.body must be empty with status 204, which has no body",
            "rules.yaml:3:44: respond.body must be empty with status 304, which has no body",
        ]
    );
}

/// Framing and hop-by-hop fields in `respond.headers` would let the configured
/// bytes desync the client (a length other than the body's) or speak for the
/// connection: refused, whatever their case.
#[test]
fn respond_headers_cannot_set_framing_or_hop_by_hop_fields() {
    let yaml = "\
routes:
  - name: a
    respond:
      body: \"ok\\n\"
      headers:
        Content-Length: \"100\"
        transfer-encoding: chunked
        CONNECTION: close
        keep-alive: timeout=5
        Upgrade: websocket
        te: trailers
        trailer: x-sum
        proxy-connection: close
        content-type: text/plain
        cache-control: no-store
";
    let said = |line: usize, name: &str| {
        format!(
            "rules.yaml:{line}:9: respond.headers cannot set {name}: sluice frames its own \
             answers and owns the connection (Content-Length, Transfer-Encoding, Connection, \
             Keep-Alive, Upgrade, TE, Trailer and Proxy-Connection are refused)"
        )
    };
    assert_eq!(
        errors(yaml),
        [
            said(6, "Content-Length"),
            said(7, "transfer-encoding"),
            said(8, "CONNECTION"),
            said(9, "keep-alive"),
            said(10, "Upgrade"),
            said(11, "te"),
            said(12, "trailer"),
            said(13, "proxy-connection"),
        ]
    );
}

/// A timeout above a day is a typo (`100d` for `100s`) that holds connections or
/// requests all but forever: refused, for every duration that is a timeout.
#[test]
fn timeouts_above_one_day_are_refused() {
    let yaml = "\
server:
  request_header_timeout: 100d
  idle_timeout: 2d
  shutdown_grace: 25h
  send_timeout: 1d
  request_body_timeout: 1441m
  tunnel_idle_timeout: 3d
store:
  backend: redis
  redis: {url: redis://127.0.0.1:6379, timeout: 2d}
upstreams:
  api: {targets: [http://127.0.0.1:3000], connect_timeout: 2d, timeout: 90000s}
routes:
  - name: a
    upstream: api
    limits: [{algorithm: gcra, rate: 1/s}]
    on_limit: delay
    max_delay: 2d
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:2:27: request_header_timeout must be at most 1d, found 100d",
            "rules.yaml:3:17: idle_timeout must be at most 1d, found 2d",
            "rules.yaml:4:19: shutdown_grace must be at most 1d, found 25h",
            "rules.yaml:6:25: request_body_timeout must be at most 1d, found 1441m",
            "rules.yaml:7:24: tunnel_idle_timeout must be at most 1d, found 3d",
            "rules.yaml:10:49: timeout must be at most 1d, found 2d",
            "rules.yaml:12:60: connect_timeout must be at most 1d, found 2d",
            "rules.yaml:12:73: timeout must be at most 1d, found 25h",
            "rules.yaml:18:16: max_delay must be at most 1d, found 2d",
        ]
    );
}

/// `header:x_api_key` could never be found: such names are dropped from requests.
#[test]
fn header_names_with_an_underscore_are_refused_where_requests_are_read() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    key: [ip, \"header:x_api_key\"]
    match: {headers: {x_tenant: acme}}
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:4:15: key \"header:x_api_key\": header names with \"_\" are dropped from requests (as nginx does), so this header is never there; write it with \"-\"",
            "rules.yaml:5:23: match.headers: header names with \"_\" are dropped from requests (as nginx does), so \"x_tenant\" never matches; write it with \"-\"",
        ]
    );
}

// === limits ===

#[test]
fn limit_names_are_unique_within_a_route() {
    let yaml = with_limit(
        "      - {name: x, algorithm: gcra, rate: 1/s}\n      - {name: x, algorithm: gcra, rate: 2/s}\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:7:16: limit name \"x\" is already used at line 6; limit names must be unique \
         within a list"
    );
}

#[test]
fn default_limit_names_count_for_uniqueness() {
    let yaml = with_limit(
        "      - {algorithm: gcra, rate: 1/s}\n      - {name: gcra_0, algorithm: gcra, rate: 2/s}\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:7:16: limit name \"gcra_0\" is already used at line 6; limit names must be \
         unique within a list (a limit without a name is called <algorithm>_<index>)"
    );
    // Unnamed limits get distinct names from their positions.
    loads(&with_limit(
        "      - {algorithm: gcra, rate: 1/s}\n      - {algorithm: gcra, rate: 2/s}\n",
    ));
}

#[test]
fn limit_names_are_unique_within_an_override() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    limits: [{name: x, algorithm: gcra, rate: 1/s}]
    overrides:
      - keys: [k]
        limits:
          - {algorithm: gcra, rate: 1/s}
          - {name: gcra_0, algorithm: gcra, rate: 2/s}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:9:20: limit name \"gcra_0\" is already used at line 8; limit names must be \
         unique within a list (a limit without a name is called <algorithm>_<index>)"
    );
}

#[test]
fn limit_name_is_not_empty() {
    let yaml = with_limit("      - algorithm: gcra\n        name: ''\n        rate: 1/s\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:7:15: limit name must not be empty (omit it for the default gcra_0)"
    );
}

#[test]
fn window_algorithms_need_limit_and_window() {
    let yaml = with_limit("      - algorithm: fixed_window\n        window: 1m\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:6:9: fixed_window needs limit, the number of requests per window"
    );
    let yaml = with_limit("      - algorithm: sliding_window\n        limit: 5\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:6:9: sliding_window needs window, a duration like 1m"
    );
    let yaml = with_limit("      - algorithm: sliding_log\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:6:9: sliding_log needs limit and window, like limit: 100 and window: 1m"
    );
}

#[test]
fn window_algorithms_reject_rate_burst_and_lease() {
    let yaml = with_limit(
        "      - algorithm: fixed_window\n        limit: 5\n        window: 1m\n        rate: 1/s\n        burst: 2\n        lease: 1m\n",
    );
    assert_eq!(
        errors(&yaml),
        [
            "rules.yaml:9:9: fixed_window does not take rate; it takes limit and window",
            "rules.yaml:10:9: fixed_window does not take burst; it takes limit and window",
            "rules.yaml:11:9: fixed_window does not take lease; it takes limit and window",
        ]
    );
}

#[test]
fn window_month_is_for_fixed_window_only() {
    assert_eq!(
        errors(&with_limit(
            "      - algorithm: fixed_window\n        limit: 100\n        window: month\n"
        )),
        Vec::<String>::new()
    );
    let yaml = with_limit(
        "      - algorithm: sliding_window\n        limit: 100\n        window: month\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:8:17: sliding_window does not take window: month (calendar months are for fixed_window only); give a duration like 30d"
    );
    let yaml = with_limit(
        "      - algorithm: fixed_window\n        limit: 100\n        window: monthly\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:8:17: routes[0].limits[0].window: expected a duration like 10s, 1m, 1h or 1d, or month, found \"monthly\""
    );
}

#[test]
fn bucket_algorithms_need_rate() {
    let yaml = with_limit("      - algorithm: token_bucket\n        burst: 5\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:6:9: token_bucket needs rate, like 10/s"
    );
}

#[test]
fn bucket_algorithms_reject_limit_window_and_lease() {
    let yaml = with_limit(
        "      - algorithm: gcra\n        rate: 1/s\n        limit: 5\n        window: 1m\n        lease: 1m\n",
    );
    assert_eq!(
        errors(&yaml),
        [
            "rules.yaml:8:9: gcra does not take limit; it takes rate and optionally burst",
            "rules.yaml:9:9: gcra does not take window; it takes rate and optionally burst",
            "rules.yaml:10:9: gcra does not take lease; it takes rate and optionally burst",
        ]
    );
}

#[test]
fn concurrency_takes_limit_and_lease_only() {
    assert_eq!(
        errors(&with_limit(
            "      - algorithm: concurrency\n        limit: 5\n        lease: 30s\n"
        )),
        Vec::<String>::new()
    );
    let yaml = with_limit(
        "      - algorithm: concurrency\n        limit: 5\n        window: 1m\n        rate: 1/s\n        burst: 2\n        cost: 2\n",
    );
    assert_eq!(
        errors(&yaml),
        [
            "rules.yaml:8:9: concurrency does not take window; it takes limit and optionally lease",
            "rules.yaml:9:9: concurrency does not take rate; it takes limit and optionally lease",
            "rules.yaml:10:9: concurrency does not take burst; it takes limit and optionally lease",
            "rules.yaml:11:9: concurrency does not take cost: each request in flight takes one slot",
        ]
    );
    assert_eq!(
        errors(&with_limit(
            "      - algorithm: concurrency\n        lease: 1m\n"
        )),
        ["rules.yaml:6:9: concurrency needs limit, the requests of a key in flight at once"]
    );
    assert_eq!(
        errors(&with_limit(
            "      - algorithm: concurrency\n        limit: 0\n        lease: 0s\n"
        )),
        [
            "rules.yaml:7:16: limit must be greater than 0",
            "rules.yaml:8:16: lease must be at least 1ms",
        ]
    );
    assert_eq!(
        errors(&with_limit(
            "      - algorithm: concurrency\n        limit: 1\n        lease: 8d\n"
        )),
        ["rules.yaml:8:16: lease must be at most 7d: it is how long a slot stays taken after an instance died"]
    );
}

#[test]
fn concurrency_cannot_delay() {
    let yaml = with_limit(
        "      - {name: inflight, algorithm: concurrency, limit: 5}\n    on_limit: delay\n    max_delay: 1s\n",
    );
    assert_eq!(
        errors(&yaml),
        ["rules.yaml:7:15: on_limit: delay is valid only with token_bucket and gcra, found \"inflight\" (concurrency)"]
    );
}

#[test]
fn zero_limits_windows_rates_bursts_and_costs() {
    let yaml = with_limit(
        "      - algorithm: fixed_window\n        limit: 0\n        window: 0s\n        cost: 0\n",
    );
    assert_eq!(
        errors(&yaml),
        [
            "rules.yaml:7:16: limit must be greater than 0",
            "rules.yaml:8:17: window must be greater than 0",
            "rules.yaml:9:15: cost must be greater than 0",
        ]
    );
    let yaml = with_limit("      - algorithm: token_bucket\n        rate: 0/s\n        burst: 0\n");
    assert_eq!(
        errors(&yaml),
        [
            "rules.yaml:7:15: the rate's count must be greater than 0, like 10/s",
            "rules.yaml:8:16: burst must be greater than 0",
        ]
    );
    let yaml = with_limit("      - algorithm: gcra\n        rate: 5/0s\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:7:15: the rate's period must be greater than 0, like 10/s or 5/10s"
    );
}

#[test]
fn cost_above_limit_or_burst_could_never_pass() {
    let yaml = with_limit(
        "      - algorithm: sliding_log\n        limit: 5\n        window: 1m\n        cost: 6\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:9:15: cost 6 is greater than limit 5: no request could ever pass"
    );
    let yaml = with_limit(
        "      - algorithm: gcra\n        rate: 10/s\n        burst: 3\n        cost: 4\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:9:15: cost 4 is greater than burst 3: no request could ever pass"
    );
    let yaml =
        with_limit("      - algorithm: token_bucket\n        rate: 10/s\n        cost: 11\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:8:15: cost 11 is greater than burst 10 (the default: the rate's count): no \
         request could ever pass"
    );
    // Equal is fine: a full bucket admits it.
    loads(&with_limit(
        "      - algorithm: token_bucket\n        rate: 10/s\n        cost: 10\n",
    ));
}

#[test]
fn numbers_too_large_for_exact_arithmetic() {
    let yaml = with_limit(
        "      - algorithm: fixed_window\n        limit: 1099511627777\n        window: 1s\n",
    );
    assert_eq!(
        error(&yaml),
        "rules.yaml:7:16: limit 1099511627777 is too large: at most 2^40 (1099511627776) for \
         exact arithmetic in the Redis store"
    );
    loads(&with_limit(
        "      - algorithm: fixed_window\n        limit: 1099511627776\n        window: 1s\n",
    ));
    // 2^50 = 1125899906842624; 1d = 86400000000us; 7/d does not reduce.
    let yaml = with_limit("      - algorithm: gcra\n        rate: 7/d\n        burst: 13032\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:8:16: burst 13032 × the rate's period (86400000000µs) exceeds 2^50, the \
         limit for exact arithmetic in the Redis store; lower the burst or use a rate whose \
         count divides its period"
    );
    loads(&with_limit(
        "      - algorithm: gcra\n        rate: 7/d\n        burst: 13031\n",
    ));
    // Reduced to lowest terms, 864000/d is 1 per 100ms: fine.
    loads(&with_limit(
        "      - algorithm: token_bucket\n        rate: 864000/d\n",
    ));
    let yaml = with_limit("      - algorithm: token_bucket\n        rate: 999983/d\n");
    assert_eq!(
        error(&yaml),
        "rules.yaml:7:15: burst 999983 (the default: the rate's count) × the rate's period \
         (86400000000µs) exceeds 2^50, the limit for exact arithmetic in the Redis store; lower \
         the burst or use a rate whose count divides its period"
    );
}

// === on_limit: delay ===

#[test]
fn delay_only_with_token_bucket_and_gcra() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    on_limit: delay
    max_delay: 1s
    limits:
      - {algorithm: gcra, rate: 1/s}
      - {name: daily, algorithm: fixed_window, limit: 5, window: 1d}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:15: on_limit: delay is valid only with token_bucket and gcra, found \
         \"daily\" (fixed_window)"
    );
}

#[test]
fn delay_checks_the_limits_of_overrides_too() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    on_limit: delay
    max_delay: 1s
    limits: [{algorithm: token_bucket, rate: 1/s}]
    overrides:
      - keys: [vip]
        limits: [{algorithm: sliding_window, limit: 5, window: 1m}]
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:15: on_limit: delay is valid only with token_bucket and gcra, found \
         \"sliding_window_0\" (sliding_window)"
    );
}

#[test]
fn delay_needs_a_positive_max_delay() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    on_limit: delay
    limits: [{algorithm: gcra, rate: 1/s}]
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:15: on_limit: delay needs max_delay, how long a request may wait for \
         capacity (like 2s)"
    );
    let yaml = "\
routes:
  - name: a
    respond: {}
    on_limit: delay
    max_delay: 0ms
    limits: [{algorithm: gcra, rate: 1/s}]
";
    assert_eq!(
        error(yaml),
        "rules.yaml:5:16: max_delay must be greater than 0"
    );
}

#[test]
fn max_delay_without_delay_is_accepted() {
    // SPEC's example does this; it has no effect.
    let yaml = "\
routes:
  - name: a
    respond: {}
    max_delay: 2s
    limits: [{algorithm: gcra, rate: 1/s}]
";
    assert!(sluice::config::parse(yaml, std::path::Path::new("rules.yaml")).is_ok());
}

#[test]
fn names_use_a_safe_alphabet() {
    assert_eq!(
        error("routes:\n  - name: a:b\n    respond: {}\n"),
        "rules.yaml:2:11: route name \"a:b\" may use only letters, digits, '_', '-' and '.' (it names metrics and stored keys)"
    );
    assert_eq!(
        error("routes:\n  - name: a\n    respond: {}\n    limits: [{name: 'x\"y', algorithm: gcra, rate: 1/s}]\n"),
        "rules.yaml:4:21: limit name \"x\\\"y\" may use only letters, digits, '_', '-' and '.' (it appears in headers and stored keys)"
    );
}

#[test]
fn overrides_need_keys_and_limits() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    limits: [{algorithm: gcra, rate: 1/s}]
    overrides:
      - keys: []
        limits: []
      - keys: ['']
        limits: [{algorithm: gcra, rate: 9/s}]
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:6:15: an override needs at least one key in keys, or claims",
            "rules.yaml:7:17: an override needs at least one limit in limits",
            "rules.yaml:8:16: override keys must not be empty",
        ]
    );
}

#[test]
fn overrides_need_limits_on_the_route() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    overrides:
      - keys: [vip]
        limits: [{algorithm: gcra, rate: 9/s}]
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:5: overrides only make sense on a route with limits: they give some keys \
         other limits"
    );
}

// === key ===

#[test]
fn key_parts_are_known() {
    let yaml = "routes:\n  - name: a\n    respond: {}\n    key: header-x\n";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:10: unknown key \"header-x\", expected ip, global, header:NAME, query:NAME, \
         cookie:NAME, form:NAME, json:/POINTER, jwt:CLAIM or jwt:/POINTER"
    );
}

#[test]
fn key_names_are_not_empty_and_headers_are_valid() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    key: [ip, 'cookie:', 'header:x api', 'query:page', global]
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:4:15: key \"cookie:\" needs a name after \"cookie:\"",
            "rules.yaml:4:26: key \"header:x api\": \"x api\" is not a valid HTTP header name",
        ]
    );
}

/// Body keys: a form field needs a name, a JSON value an RFC 6901 pointer.
#[test]
fn body_keys_name_a_field_or_a_json_pointer() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    key: ['form:', 'json:', 'json:user', 'json:/a~2b', 'form:username', 'json:/user/n~1a~0me']
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:4:11: key \"form:\" needs a name after \"form:\"",
            "rules.yaml:4:20: key \"json:\" needs a JSON pointer after \"json:\", like json:/user/name",
            "rules.yaml:4:29: key \"json:user\": \"user\" is not a JSON pointer (RFC 6901): it starts \
             with \"/\", and a \"~\" is written \"~0\" (and a \"/\" in a name \"~1\")",
            "rules.yaml:4:42: key \"json:/a~2b\": \"/a~2b\" is not a JSON pointer (RFC 6901): it \
             starts with \"/\", and a \"~\" is written \"~0\" (and a \"/\" in a name \"~1\")",
        ]
    );
}

#[test]
fn a_limit_key_is_read_like_the_route_key() {
    let yaml = with_limit(
        "      - algorithm: fixed_window\n        limit: 1\n        window: 1m\n        key: [ip, 'cookie:', body]\n",
    );
    assert_eq!(
        errors(&yaml),
        [
            "rules.yaml:9:19: key \"cookie:\" needs a name after \"cookie:\"",
            "rules.yaml:9:30: unknown key \"body\", expected ip, global, header:NAME, query:NAME, cookie:NAME, form:NAME, json:/POINTER, jwt:CLAIM or jwt:/POINTER",
        ]
    );
}

#[test]
fn counts_and_costs_from_the_response_need_an_upstream_and_no_concurrency() {
    let yaml = "\
upstreams: {api: {targets: [http://127.0.0.1:3000]}}
routes:
  - name: a
    respond: {}
    limits:
      - {algorithm: fixed_window, limit: 5, window: 1m, count: {status: [401]}}
      - {algorithm: token_bucket, rate: 10/s, cost: {response_header: x-tokens}}
  - name: b
    upstream: api
    limits:
      - {algorithm: concurrency, limit: 5, count: {status: [500]}}
      - {algorithm: fixed_window, limit: 5, window: 1m, count: {status: [401, 5xx, 600, 6xx, nope]}}
      - {algorithm: fixed_window, limit: 5, window: 1m, count: {status: []}}
      - {algorithm: token_bucket, rate: 10/s, cost: {response_header: \"x tokens\"}}
";
    let respond = "from the upstream's response on a route that answers with respond: sluice's own answers are never counted, so this limit would never be charged";
    let status = |s: &str| {
        format!("{s:?} is not a status: write a code from 100 to 599 (401) or a class (\"5xx\")")
    };
    assert_eq!(
        errors(yaml),
        [
            format!("rules.yaml:6:57: count {respond}"),
            format!("rules.yaml:7:47: cost {respond}"),
            "rules.yaml:11:44: concurrency does not take count: it counts the requests in flight, not answers".to_string(),
            format!("rules.yaml:12:84: {}", status("600")),
            format!("rules.yaml:12:89: {}", status("6xx")),
            format!("rules.yaml:12:94: {}", status("nope")),
            "rules.yaml:13:73: count.status needs at least one status, like [401, 403] or [\"5xx\"]".to_string(),
            "rules.yaml:14:71: \"x tokens\" is not a valid HTTP header name".to_string(),
        ]
    );
}

/// An interim answer (1xx) is never a request's response: a limit counting one
/// would never be charged.
#[test]
fn count_statuses_are_final_statuses() {
    let yaml = "\
upstreams: {api: {targets: [http://127.0.0.1:3000]}}
routes:
  - name: a
    upstream: api
    limits:
      - {algorithm: fixed_window, limit: 5, window: 1m, count: {status: [103, 1xx, 199, 200, 2xx]}}
";
    let never = |s: &str| {
        format!("{s:?} can never count: a limit counts final answers, 200 to 599 (a 1xx is an interim answer, never the response)")
    };
    assert_eq!(
        errors(yaml),
        [
            format!("rules.yaml:6:74: {}", never("103")),
            format!("rules.yaml:6:79: {}", never("1xx")),
            format!("rules.yaml:6:84: {}", never("199")),
        ]
    );
}

/// The warnings a file that loads gets, as `check` prints them.
fn warnings(yaml: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.yaml");
    std::fs::write(&path, yaml).unwrap();
    let loaded = match load(&path) {
        Ok(loaded) => loaded,
        Err(e) => panic!("expected a clean load, got:\n{e}"),
    };
    let prefix = format!("{}/", dir.path().display());
    loaded
        .warnings
        .iter()
        .map(|w| w.to_string().strip_prefix(&prefix).unwrap().to_string())
        .collect()
}

/// `count` by status charges a request when its answer arrives, so the requests in
/// flight meanwhile all pass the check: without a `concurrency` limit on the same
/// key, up to limit + requests in flight − 1 are admitted. `check` warns, and is
/// quiet when such a limit is there (in the same list, on the same key).
#[test]
fn count_by_status_without_concurrency_is_warned_about() {
    let flight = |name: &str| {
        format!("warning: limit {name} counts by status, charged when the answer arrives: without a concurrency limit on the same key, up to limit + requests in flight - 1 are admitted")
    };
    let yaml = "\
upstreams: {api: {targets: [http://127.0.0.1:3000]}}
routes:
  - name: login
    upstream: api
    key: ip
    limits:
      - {name: failures, algorithm: fixed_window, limit: 5, window: 1m, count: {status: [401]}}
      - {name: per_user, key: \"form:user\", algorithm: fixed_window, limit: 5, window: 1m, count: {status: [401]}}
      - {algorithm: concurrency, limit: 2, key: \"form:user\"}
    overrides:
      - keys: [10.0.0.1]
        limits:
          - {name: failures, algorithm: sliding_window, limit: 50, window: 1m, count: {status: [\"4xx\"]}}
";
    assert_eq!(
        warnings(yaml),
        [
            format!("rules.yaml:7:80: {}", flight("failures")),
            format!("rules.yaml:13:87: {}", flight("failures")),
        ]
    );
    // With a concurrency limit on the route's key: no warning.
    let quiet = yaml.replace("key: \"form:user\"}", "key: ip}");
    assert!(quiet.contains("limit: 2, key: ip}"), "{quiet}");
    assert_eq!(
        warnings(&quiet),
        [
            format!("rules.yaml:8:98: {}", flight("per_user")),
            format!("rules.yaml:13:87: {}", flight("failures")),
        ]
    );
}

/// The memory store keeps a key's month in this process: a restart, or the key's
/// eviction, starts it afresh.
#[test]
fn a_month_on_the_memory_store_is_warned_about() {
    let month = "warning: window: month on the memory store starts afresh when sluice restarts or the key is evicted (store.memory.max_keys); a month that must hold needs backend: redis";
    let yaml = with_limit(
        "      - {name: monthly, algorithm: fixed_window, limit: 100000, window: month}\n",
    );
    assert_eq!(warnings(&yaml), [format!("rules.yaml:6:73: {month}")]);
    let redis =
        format!("store: {{backend: redis, redis: {{url: redis://127.0.0.1:6379}}}}\n{yaml}");
    assert_eq!(warnings(&redis), Vec::<String>::new());
}

#[test]
fn composite_key_is_not_empty() {
    let yaml = "routes:\n  - name: a\n    respond: {}\n    key: []\n";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:10: the key list must not be empty: expected one or more of ip, global, \
         header:NAME, query:NAME, cookie:NAME, form:NAME, json:/POINTER"
    );
}

// === match ===

#[test]
fn paths_start_with_a_slash() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    match:
      path: login
      path_prefix: v1/
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:5:13: path must start with \"/\", found \"login\"",
            "rules.yaml:6:20: path_prefix must start with \"/\", found \"v1/\"",
        ]
    );
}

#[test]
fn path_regex_compiles() {
    let yaml = "routes:\n  - name: a\n    respond: {}\n    match: {path_regex: '^/users/(\\d+'}\n";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:25: path_regex is not a valid regular expression: unclosed group"
    );
}

#[test]
fn host_is_a_name_or_a_wildcard() {
    for (host, col) in [
        ("'*'", 19),
        ("a.*.example.com", 19),
        ("'*example.com'", 19),
        ("api.example.com:8080", 19),
        ("'api example.com'", 19),
    ] {
        let yaml =
            format!("routes:\n  - name: a\n    match: {{host: {host}}}\n    respond: {{}}\n");
        let shown = host.trim_matches('\'');
        assert_eq!(
            error(&yaml),
            format!(
                "rules.yaml:3:{col}: expected a host name like api.example.com or a wildcard like \
                 *.example.com, found {shown:?}"
            )
        );
    }
    loads("routes:\n  - name: a\n    match: {host: '*.example.com'}\n    respond: {}\n");
    loads("routes:\n  - name: a\n    match: {host: Api.Example.com}\n    respond: {}\n");
}

#[test]
fn methods_are_tokens() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    match: {methods: [GET, 'PO ST']}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:28: \"PO ST\" is not a valid HTTP method, expected a token like GET or POST"
    );
    let yaml = "routes:\n  - name: a\n    respond: {}\n    match: {methods: [get]}\n";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:23: \"get\" is not a registered HTTP method (methods are case-sensitive; sluice answers 400 to unregistered ones), expected one like GET or POST"
    );
    let yaml = "routes:\n  - name: a\n    respond: {}\n    match: {methods: []}\n";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:22: methods must list at least one method (omit it to match every method)"
    );
}

#[test]
fn match_headers_are_valid() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    match:
      headers:
        x-tenant: acme
        'bad name': '*'
        x-ok: \"line\\nbreak\"
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:7:9: \"bad name\" is not a valid HTTP header name (expected letters, \
             digits and !#$%&'*+-.^_`|~)",
            "rules.yaml:8:15: invalid HTTP header value: control characters other than tab are \
             not allowed",
        ]
    );
}

// === respond ===

#[test]
fn respond_status_and_headers() {
    let yaml = "\
routes:
  - name: a
    respond:
      status: 99
      headers: {content-type: text/plain, 'x:y': z}
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:4:15: respond.status must be between 200 and 599, found 99",
            "rules.yaml:5:43: \"x:y\" is not a valid HTTP header name (expected letters, digits \
             and !#$%&'*+-.^_`|~)",
        ]
    );
    let yaml = "routes:\n  - name: a\n    respond: {status: 600}\n";
    assert_eq!(
        error(yaml),
        "rules.yaml:3:23: respond.status must be between 200 and 599, found 600"
    );
}

// === deny ===

#[test]
fn deny_status_and_keys() {
    let yaml = "deny:\n  keys: [ok, '']\n  status: 302\nroutes: []\n";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:2:14: deny.keys entries must not be empty",
            "rules.yaml:3:11: deny.status must be between 400 and 599, found 302",
        ]
    );
}

/// A key no request can carry (requests with such a key value get 400, keys are
/// read trimmed) would never match: refused, in the deny list and in an override
/// alike. Text of any script can be a body key.
#[test]
fn keys_no_request_can_carry_are_refused() {
    let yaml = "deny:\n  keys: [ok, \"k\\u00a0\", \"\\u202ek\"]\nupstreams:\n  up: {targets: [\"http://127.0.0.1:1\"]}\nroutes:\n  - name: r\n    match: {path: /}\n    upstream: up\n    key: header:x-k\n    limits: [{algorithm: gcra, rate: 9/s}]\n    overrides:\n      - keys: [\"caf\\u00e9\"]\n        limits: [{algorithm: gcra, rate: 9/s}]\n";
    let msg = "a key with a control, format, private-use or unassigned character, or white space around it, never matches: no request has such a key";
    assert_eq!(
        errors(yaml),
        [
            format!("rules.yaml:2:14: {msg}"),
            format!("rules.yaml:2:25: {msg}"),
        ]
    );
}

// === upstreams ===

#[test]
fn upstream_targets() {
    let yaml = "\
upstreams:
  api:
    targets:
      - http://127.0.0.1:3000
      - https://api.internal
      - 127.0.0.1:3000
      - ftp://h
      - http://h/v1
      - http://h/?debug=1
      - http://user:pw@h
      - http://[::1]:8080/
  none:
    targets: []
routes: []
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:6:9: expected a target like http://host[:port] or https://host[:port], \
             found \"127.0.0.1:3000\"",
            "rules.yaml:7:9: target scheme must be http or https, found \"ftp\"",
            "rules.yaml:8:9: target must not have a path, found \"/v1\"; the request's own path \
             is forwarded, expected http://host[:port] or https://host[:port]",
            "rules.yaml:9:9: target must not have a query, found \"?debug=1\", expected \
             http://host[:port] or https://host[:port]",
            "rules.yaml:10:9: target must not contain user info (user@), expected \
             http://host[:port] or https://host[:port]",
            "rules.yaml:13:14: upstream \"none\" needs at least one target, like \
             http://127.0.0.1:3000",
        ]
    );
}

#[test]
fn upstream_timeouts_and_ca() {
    let yaml = "\
upstreams:
  api:
    targets: [https://h]
    connect_timeout: 0s
    timeout: 0ms
    tls_ca: /nonexistent/sluice-test-ca.pem
routes: []
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:4:22: connect_timeout must be greater than 0",
            "rules.yaml:5:14: timeout must be greater than 0",
            "rules.yaml:6:13: CA file \"/nonexistent/sluice-test-ca.pem\" not found",
        ]
    );
}

// === admin ===

#[test]
fn admin_off_loopback_needs_a_token() {
    assert_eq!(
        error("admin:\n  listen: 0.0.0.0:9091\nroutes: []\n"),
        "rules.yaml:2:11: an admin listener off loopback needs admin.token, a non-empty bearer \
         token (admin.listen is 0.0.0.0:9091)"
    );
    assert_eq!(
        error("admin:\n  listen: 10.1.2.3:9091\n  token: ''\nroutes: []\n"),
        "rules.yaml:3:10: an admin listener off loopback needs admin.token, a non-empty bearer \
         token (admin.listen is 10.1.2.3:9091)"
    );
    loads("admin: {listen: '[::1]:9091'}\nroutes: []\n");
    loads("admin: {listen: 127.0.0.2:9091}\nroutes: []\n");
    loads("admin: {listen: 0.0.0.0:9091, token: s3cret}\nroutes: []\n");
}

#[test]
fn admin_and_server_listen_differ() {
    let yaml = "\
server: {listen: 127.0.0.1:8080}
admin: {listen: 127.0.0.1:8080}
routes: []
";
    assert_eq!(
        error(yaml),
        "rules.yaml:2:17: admin.listen must differ from server.listen (both are 127.0.0.1:8080)"
    );
    let yaml = "\
server: {listen: 0.0.0.0:9091}
routes: []
";
    assert_eq!(
        error(yaml),
        "rules.yaml:1:1: admin.listen 127.0.0.1:9091 overlaps server.listen 0.0.0.0:9091 (same \
         port, and one is a wildcard address); give the admin listener its own port"
    );
    // Port 0 picks a free port for each listener.
    loads("server: {listen: 127.0.0.1:0}\nadmin: {listen: 127.0.0.1:0}\nroutes: []\n");
}

// === store ===

#[test]
fn memory_store_max_keys() {
    assert_eq!(
        error("store:\n  memory: {max_keys: 0}\nroutes: []\n"),
        "rules.yaml:2:22: max_keys must be greater than 0"
    );
}

#[test]
fn redis_store_needs_its_section() {
    assert_eq!(
        error("store:\n  backend: redis\nroutes: []\n"),
        "rules.yaml:2:12: store.backend: redis needs a store.redis section with url (or cluster, \
         or sentinel)"
    );
    assert_eq!(
        error("store:\n  backend: redis\n  redis: {timeout: 10ms}\nroutes: []\n"),
        "rules.yaml:3:10: store.redis needs exactly one of url (one server), cluster (a list of \
         nodes) and sentinel (the primary Redis Sentinel names)"
    );
    let yaml = "\
store:
  backend: redis
  redis:
    url: redis://127.0.0.1:6379
    cluster: [redis://127.0.0.1:7000]
routes: []
";
    assert_eq!(
        error(yaml),
        "rules.yaml:5:5: store.redis needs exactly one of url, cluster and sentinel, found url \
         and cluster"
    );
    let yaml = "\
store:
  backend: redis
  redis:
    url: redis://127.0.0.1:6379
    sentinel: {master: mymaster, nodes: [redis://127.0.0.1:26379]}
routes: []
";
    assert_eq!(
        error(yaml),
        "rules.yaml:5:5: store.redis needs exactly one of url, cluster and sentinel, found url \
         and sentinel"
    );
}

/// A query parameter, fragment or database sluice's Redis connection would silently ignore
/// is refused: the store would not be what the file says.
#[test]
fn redis_urls_say_only_what_the_client_reads() {
    let yaml = "\
store:
  backend: redis
  redis:
    url: redis://10.0.0.1:26379/?sentinel=mymaster
routes: []
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:10: redis URL \"redis://10.0.0.1:26379/?sentinel=mymaster\": sluice's \
         Redis connection does not read ?sentinel=; to reach the primary that Redis Sentinel names, use \
         store.redis.sentinel: {master: mymaster, nodes: [redis://<sentinel host>:26379]} \
         instead of a url"
    );
    let yaml = "\
store:
  backend: redis
  redis:
    cluster:
      - redis://:s3cret@10.0.0.1:7000/?timeout=1s
      - redis://10.0.0.2:7000/1
      - redis://10.0.0.3:7000#insecure
      - rediss://10.0.0.4:7000/0?protocol=4#nocheck
      - rediss://10.0.0.5:7000/0?protocol=resp3#insecure
      - rediss://10.0.0.6:7000/0?protocol=resp3
routes: []
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:5:9: redis URL \"redis://***@10.0.0.1:7000/?timeout=1s\": sluice's \
             Redis connection does not read the query parameter \"timeout\" (it would be ignored); the \
             only one it reads is protocol",
            "rules.yaml:6:9: redis URL \"redis://10.0.0.2:7000/1\": Redis Cluster has only \
             database 0, found /1",
            "rules.yaml:7:9: redis URL \"redis://10.0.0.3:7000#insecure\": sluice's Redis \
             connection reads no #fragment, found #insecure",
            "rules.yaml:8:9: redis URL \"rediss://10.0.0.4:7000/0?protocol=4#nocheck\": \
             protocol must be 2, 3, resp2 or resp3, found \"4\"",
            "rules.yaml:8:9: redis URL \"rediss://10.0.0.4:7000/0?protocol=4#nocheck\": sluice's \
             Redis connection reads no #fragment, found #nocheck",
            "rules.yaml:9:9: redis URL \"rediss://10.0.0.5:7000/0?protocol=resp3#insecure\": \
             #insecure is not supported: the server's certificate is always checked; trust its \
             CA in the system's store, or name it with SSL_CERT_FILE",
        ]
    );
    assert_eq!(
        error("store:\n  backend: redis\n  redis: {url: \"redis://h:6379/zero\"}\nroutes: []\n"),
        "rules.yaml:3:16: redis URL \"redis://h:6379/zero\": expected a database number after \
         the host, like /0, found /zero"
    );
    // What the client reads passes.
    for url in [
        "redis://:pw@h:6379/3/?protocol=resp3",
        "rediss://user:pw@h:6380?protocol=2",
        "redis://h",
    ] {
        loads(&format!(
            "store:\n  backend: redis\n  redis: {{url: \"{url}\"}}\nroutes: []\n"
        ));
    }
}

#[test]
fn redis_sentinel_section() {
    let yaml = "\
store:
  backend: redis
  redis:
    sentinel:
      master: mymaster
      nodes: [rediss://10.0.0.1:26379, \"rediss://:pw@10.0.0.2:26379\"]
      password: ${REDIS_PASSWORD:-}
routes: []
";
    let loaded = loads(yaml);
    assert!(
        summary(&loaded).contains(
            "store   redis sentinel master \"mymaster\" via rediss://10.0.0.1:26379, \
             rediss://***@10.0.0.2:26379, timeout 50ms"
        ),
        "{}",
        summary(&loaded)
    );
    let yaml = "\
store:
  backend: redis
  redis:
    sentinel:
      master: \"\"
      nodes: [rediss://10.0.0.1:26379, redis://10.0.0.2:26379/0]
      username: app
routes: []
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:5:15: store.redis.sentinel.master must name the master the sentinels \
             monitor (sentinel monitor <name> ...), like mymaster",
            "rules.yaml:6:40: redis URL \"redis://10.0.0.2:26379/0\": a sentinel has no database \
             (found /0); the primary's is store.redis.sentinel.db",
            "rules.yaml:7:7: store.redis.sentinel.username needs a password too (AUTH takes both)",
        ]
    );
    let yaml = "\
store:
  backend: redis
  redis:
    sentinel: {master: m, nodes: [rediss://10.0.0.1:26379, redis://10.0.0.2:26379]}
routes: []
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:60: store.redis.sentinel.nodes must all be reached the same way (redis:// \
         or rediss://, the same ?protocol): the primary is reached that way too"
    );
    assert_eq!(
        error(
            "store:\n  backend: redis\n  redis: {sentinel: {master: m, nodes: []}}\nroutes: []\n"
        ),
        "rules.yaml:3:40: store.redis.sentinel.nodes must list at least one sentinel, like \
         [redis://10.0.0.1:26379]"
    );
}

/// What a newcomer wrote: `sluice check` exits 1 and says where to go instead.
#[test]
fn check_refuses_a_sentinel_query_in_a_url() {
    let file = crate::common::config_file(
        "store:\n  backend: redis\n  redis: {url: \"redis://10.0.0.1:26379/?sentinel=mymaster\"}\nroutes: []\n",
    );
    let out = crate::common::run_grouped(
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["check", "-c"])
            .arg(file.path())
            .env_remove("SLUICE_CONFIG"),
    )
    .expect("sluice runs");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "{}:3:16: redis URL \"redis://10.0.0.1:26379/?sentinel=mymaster\": sluice's Redis \
             connection does not read ?sentinel=; to reach the primary that Redis Sentinel names, use \
             store.redis.sentinel: {{master: mymaster, nodes: [redis://<sentinel host>:26379]}} \
             instead of a url\n",
            file.path().display()
        )
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn redis_urls_and_timeout() {
    let yaml = "\
store:
  backend: redis
  redis:
    url: http://:s3cret@127.0.0.1:6379
    timeout: 0ms
routes: []
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:4:10: expected a redis URL starting with redis:// or rediss://, found \
             \"http://***@127.0.0.1:6379\"",
            "rules.yaml:5:14: timeout must be greater than 0",
        ]
    );
    let yaml = "\
store:
  backend: redis
  redis:
    cluster:
      - rediss://10.0.0.1:7000
      - 10.0.0.2:7000
      - redis://
routes: []
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:6:9: expected a redis URL starting with redis:// or rediss://, found \
             \"10.0.0.2:7000\"",
            "rules.yaml:7:9: redis URL \"redis://\" has no host, expected like \
             redis://127.0.0.1:6379/0",
        ]
    );
    assert_eq!(
        error("store:\n  backend: redis\n  redis: {cluster: []}\nroutes: []\n"),
        "rules.yaml:3:20: store.redis.cluster must list at least one node, like \
         [redis://10.0.0.1:7000]"
    );
}

// === ban, server ===

#[test]
fn ban_values_are_positive() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    limits: [{algorithm: gcra, rate: 1/s}]
    ban: {after: 0, within: 0s, for: 0m}
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:5:18: ban.after must be greater than 0",
            "rules.yaml:5:29: ban.within must be greater than 0",
            "rules.yaml:5:38: ban.for must be greater than 0",
        ]
    );
}

#[test]
fn ban_needs_limits() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    ban: {after: 5, within: 1m, for: 1h}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:4:5: ban needs limits on the route: it bans keys that keep hitting them"
    );
}

#[test]
fn ban_needs_a_per_client_key() {
    let yaml = "\
routes:
  - name: a
    respond: {}
    key: global
    limits: [{algorithm: gcra, rate: 1/s}]
    ban: {after: 5, within: 1m, for: 1h}
";
    assert_eq!(
        error(yaml),
        "rules.yaml:6:5: ban needs a per-client key: with key: global every client shares one key, and banning it would deny nobody in particular"
    );
    let composite = yaml.replace("key: global", "key: [global, ip]");
    assert!(errors(&composite).is_empty());
}

#[test]
fn server_values_are_positive() {
    let yaml = "\
server:
  request_header_timeout: 0s
  max_request_body: 0
  max_connections: 0
  shutdown_grace: 0s
routes: []
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:2:27: request_header_timeout must be greater than 0",
            "rules.yaml:3:21: max_request_body must be greater than 0",
            "rules.yaml:4:20: max_connections must be greater than 0",
        ]
    );
}

#[test]
fn tls_files_must_exist() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    std::fs::write(&cert, "not checked here").unwrap();
    let missing = dir.path().join("key.pem");
    let yaml = format!(
        "server:\n  tls:\n    cert: {}\n    key: {}\nroutes: []\n",
        cert.display(),
        missing.display()
    );
    assert_eq!(
        errors_in(dir.path(), &yaml),
        [format!(
            "rules.yaml:4:10: key file {:?} not found",
            missing.display().to_string()
        )]
    );
    std::fs::write(&missing, "").unwrap();
    assert_eq!(errors_in(dir.path(), &yaml), Vec::<String>::new());
    let yaml = format!(
        "server:\n  tls: {{cert: {}, key: {}}}\nroutes: []\n",
        dir.path().display(),
        missing.display()
    );
    assert_eq!(
        errors_in(dir.path(), &yaml),
        [format!(
            "rules.yaml:2:15: cert file {:?} is not a file",
            dir.path().display().to_string()
        )]
    );
}

// === whole files ===

#[test]
fn all_problems_are_reported_in_file_order() {
    let yaml = "\
server: {max_connections: 0}
routes:
  - name: a
    upstream: nowhere
  - name: a
    respond: {status: 700}
deny: {status: 200}
";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:1:27: max_connections must be greater than 0",
            "rules.yaml:4:15: unknown upstream \"nowhere\", no upstreams are defined",
            "rules.yaml:5:11: route name \"a\" is already used at line 3; route names must be unique",
            "rules.yaml:6:23: respond.status must be between 200 and 599, found 700",
            "rules.yaml:7:16: deny.status must be between 400 and 599, found 200",
        ]
    );
}

/// SPEC §2's example, with its unset admin token variable given a default.
const SPEC_EXAMPLE: &str = include_str!("../fixtures/config/spec_example.yaml");

#[test]
fn the_spec_example_loads() {
    let loaded = loads(SPEC_EXAMPLE);
    assert_eq!(loaded.file.routes.len(), 4);
    let text = summary(&loaded);
    assert!(text.contains("routes  4\n"), "{text}");
    assert!(
        text.contains("  payments-out prefix /pay/ -> upstream api   key global\n"),
        "{text}"
    );
    assert!(!text.contains("premium-key-1"), "{text}");
}

#[test]
fn the_spec_example_as_written_loads() {
    assert_eq!(errors(SPEC_EXAMPLE), Vec::<String>::new());
}

#[test]
fn the_summary_never_shows_secrets() {
    let yaml = "\
admin: {listen: 0.0.0.0:9091, token: hunter2}
store:
  backend: redis
  redis: {url: 'redis://default:hunter2@127.0.0.1:6379/0'}
routes: []
";
    let text = summary(&loads(yaml));
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("admin 0.0.0.0:9091 (token)"), "{text}");
    assert!(
        text.contains("store   redis redis://default:***@127.0.0.1:6379/0, timeout 50ms"),
        "{text}"
    );
}

#[test]
fn unreadable_file_has_no_position() {
    let path = PathBuf::from("/nonexistent/sluice/rules.yaml");
    let err = load(&path).unwrap_err();
    assert_eq!(err.0.len(), 1);
    assert_eq!(err.0[0].line, 0);
    assert!(
        err.to_string()
            .starts_with("/nonexistent/sluice/rules.yaml: cannot read: "),
        "{err}"
    );
}
#[test]
fn byte_order_mark_crlf_and_wide_characters_keep_columns() {
    // serde_yaml (libyaml) and the position index must count alike.
    let yaml = "\u{feff}server: {listen: nope}\r\nroutes: []\r\n";
    assert_eq!(
        error(yaml),
        "rules.yaml:1:18: server.listen: expected a listen address like 0.0.0.0:8080 or \
         [::1]:9091, found \"nope\""
    );
    let yaml = "\u{feff}server: {max_connections: 0}\r\nroutes:\r\n  - {name: é, respond: {status: 9}}\r\n";
    assert_eq!(
        errors(yaml),
        [
            "rules.yaml:1:27: max_connections must be greater than 0",
            "rules.yaml:3:12: route name \"é\" may use only letters, digits, '_', '-' and '.' (it names metrics and stored keys)",
            "rules.yaml:3:33: respond.status must be between 200 and 599, found 9",
        ]
    );
    let yaml = "routes:\n  - {name: é, respond: {stetus: 9}}\n";
    assert_eq!(
        error(yaml),
        "rules.yaml:2:25: routes[0].respond: unknown field `stetus`, expected one of `status`, \
         `body`, `headers`"
    );
}

#[test]
fn rates_faster_than_one_per_microsecond_are_refused() {
    assert_eq!(
        error("routes:\n  - name: a\n    respond: {}\n    limits: [{algorithm: gcra, rate: 1500000/s}]\n"),
        "rules.yaml:4:38: the rate is faster than one request per microsecond, which the stores cannot time"
    );
}

/// `cost: {response_json, estimate, default}`: pointers are RFC 6901, `estimate` is
/// a number or a pointer into the request body, and `check` refuses what it cannot
/// settle exactly, each at its line and column, saying why.
#[test]
fn costs_read_from_the_body_take_pointers_and_an_estimate_they_can_settle() {
    let yaml = "\
upstreams: {api: {targets: [http://127.0.0.1:3000]}}
store: {backend: redis, redis: {url: redis://127.0.0.1:6379}}
routes:
  - name: a
    upstream: api
    limits:
      - {name: a0, algorithm: token_bucket, rate: 10/s, cost: {response_json: usage/total_tokens}}
      - {name: a1, algorithm: token_bucket, rate: 10/s, cost: {response_json: [/ok, \"/a~2b\"]}}
      - {name: a2, algorithm: token_bucket, rate: 10/s, cost: {response_json: /u, response_header: x-u}}
      - {name: a3, algorithm: token_bucket, rate: 10/s, cost: {response_header: x-u, estimate: 5}}
      - {name: a4, algorithm: fixed_window, limit: 100, window: 1m, cost: {response_json: /u, estimate: 5}}
      - {name: a5, algorithm: gcra, rate: 10/s, burst: 20, cost: {response_json: /u, estimate: 21}}
      - {name: a6, algorithm: token_bucket, rate: 10/s, cost: {response_json: /u, estimate: max_tokens}}
      - {name: a7, algorithm: token_bucket, rate: 10/s, cost: {response_json: /u, estimate: \"json:max\"}}
      - {name: a8, algorithm: token_bucket, rate: 10/s, cost: {response_json: /u, estimate: 0}}
  - name: b
    upstream: api
    limits:
      - {name: a9, algorithm: token_bucket, rate: 10/s, reserve: 2, cost: {response_json: /u}}
  - name: c
    upstream: api
    limits:
      - {name: b0, algorithm: concurrency, limit: 3, cost: {response_json: /u}}
      - {name: b1, algorithm: gcra, rate: 1/s, count: {status: [200]}, cost: {response_json: /u}}
";
    let help = "a JSON pointer (RFC 6901) starts with \"/\", like /usage/total_tokens, and a \"~\" in a name is written \"~0\" (a \"/\" \"~1\")";
    assert_eq!(
        errors(yaml),
        [
            format!("rules.yaml:7:79: \"usage/total_tokens\" is not a JSON pointer: {help}"),
            format!("rules.yaml:8:85: \"/a~2b\" is not a JSON pointer: {help}"),
            "rules.yaml:9:64: a cost comes from response_header or response_json, not both".to_string(),
            "rules.yaml:10:86: estimate goes with response_json: a cost from a header is known with the response's head, and checked for one unit before forwarding".to_string(),
            "rules.yaml:11:95: fixed_window does not take estimate: what a response charges less than its estimate is given back, which is exact only for token_bucket and gcra (a window or a log would have to find the charge by its time); use token_bucket or gcra, or leave estimate out (then the limit is checked for one unit before forwarding and charged when the response ends)".to_string(),
            "rules.yaml:12:96: estimate 21 is greater than the limit's 20: no request could ever be admitted".to_string(),
            "rules.yaml:13:93: estimate is a number of units, or \"json:/pointer\" into the request's JSON body (like json:/max_tokens), not \"max_tokens\"".to_string(),
            format!("rules.yaml:14:93: \"max\" is not a JSON pointer: {help}"),
            "rules.yaml:15:93: estimate must be greater than 0 (or left out)".to_string(),
            "rules.yaml:19:57: a limit charged from the response (count, or a cost from a response header or body) does not take reserve: its charge is known only after the request".to_string(),
            "rules.yaml:23:54: concurrency does not take cost: each request in flight takes one slot".to_string(),
            "rules.yaml:24:79: response_json does not go with count: the body's cost is charged whatever the status (an answer without usage charges default); write default: 0 to charge nothing for those".to_string(),
        ]
    );
    let ok = "\
upstreams: {api: {targets: [http://127.0.0.1:3000]}}
routes:
  - name: llm
    upstream: api
    key: header:x-api-key
    limits:
      - {name: tokens, algorithm: token_bucket, rate: 100000/m, burst: 100000, cost: {response_json: /usage/total_tokens, estimate: \"json:/max_tokens\"}}
      - {name: claude, algorithm: gcra, rate: 1000/m, cost: {response_json: [/message/usage/input_tokens, /usage/output_tokens], estimate: 500, default: 0}}
      - {name: monthly, algorithm: fixed_window, limit: 100000, window: month, cost: {response_json: /usage/total_tokens}}
";
    let text = summary(&loads(ok));
    for line in [
        "tokens: token_bucket 100000/m burst 100000 cost from the response body at /usage/total_tokens (default 1), the request's json:/max_tokens held at admission (default 1);",
        "claude: gcra 1000/m burst 1000 cost from the response body at /message/usage/input_tokens + /usage/output_tokens (default 0), 500 held at admission;",
        "monthly: fixed_window 100000 per calendar month (UTC) cost from the response body at /usage/total_tokens (default 1)\n",
    ] {
        assert!(text.contains(line), "{line}\nnot in:\n{text}");
    }
}
