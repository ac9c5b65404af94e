//! Running sluice: live operations (reload, the admin API, bans), the watcher in a
//! busy folder, the admin port against browsers, the `sluice` binary's commands,
//! the dashboard, and `/metrics` under promtool.

#[path = "../common/mod.rs"]
mod common;

mod admin_guard;
mod cli;
mod cli_deny;
mod cli_health;
mod dashboard;
mod live_ops;
mod metrics_lint;
mod top;
mod watch;
