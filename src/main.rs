//! The `sluice` command line: parse arguments, set up logging, call the library.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use sluice::cli::admin_api::{self, Action, Endpoint, Ttl};
use sluice::deny::Target;
use tracing_subscriber::EnvFilter;

/// mimalloc, measured against glibc's malloc in an A/B run of the same build: about
/// 15% less CPU per proxied request (see docs/performance.md).
#[global_allocator]
static ALLOC: Alloc = Alloc;

/// mimalloc as the global allocator, asked for an aligned block only when the
/// alignment needs it. (The `mimalloc` crate asks for every block aligned, and
/// mimalloc 3 serves an aligned request for more than 1 KiB by over-allocating and
/// marking the page, a slower allocation and a slower free: about 400 instructions per
/// proxied request in all.)
struct Alloc;

/// The alignment of every block mimalloc hands out: its size classes are whole
/// words, on word-aligned pages.
const WORD: usize = std::mem::size_of::<usize>();

// SAFETY: each method passes its arguments to the mimalloc function of the same
// contract. A block from `mi_malloc`, `mi_zalloc` or `mi_realloc` is aligned to a
// word at least (see `WORD`), so these serve only layouts that ask for no more; the
// rest go to the `_aligned` variants. `mi_free` frees a block from any of them.
unsafe impl std::alloc::GlobalAlloc for Alloc {
    #[inline]
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use libmimalloc_sys::{mi_malloc, mi_malloc_aligned};
        // SAFETY: see the impl.
        unsafe { by_alignment(layout, mi_malloc, mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        use libmimalloc_sys::{mi_zalloc, mi_zalloc_aligned};
        // SAFETY: see the impl.
        unsafe { by_alignment(layout, mi_zalloc, mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: std::alloc::Layout) {
        // SAFETY: see the impl.
        unsafe { libmimalloc_sys::mi_free(ptr.cast()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        use libmimalloc_sys::{mi_realloc, mi_realloc_aligned};
        // SAFETY: see the impl.
        unsafe {
            if layout.align() <= WORD {
                mi_realloc(ptr.cast(), new_size).cast()
            } else {
                mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
            }
        }
    }
}

/// A block for `layout` from `plain` when a word's alignment serves it, else from
/// `aligned`.
///
/// # Safety
/// As `GlobalAlloc::alloc`; `plain` and `aligned` are a mimalloc allocation
/// function and its `_aligned` variant.
#[inline]
unsafe fn by_alignment(
    layout: std::alloc::Layout,
    plain: unsafe extern "C" fn(usize) -> *mut std::ffi::c_void,
    aligned: unsafe extern "C" fn(usize, usize) -> *mut std::ffi::c_void,
) -> *mut u8 {
    // SAFETY: the caller's.
    unsafe {
        if layout.align() <= WORD {
            plain(layout.size()).cast()
        } else {
            aligned(layout.size(), layout.align()).cast()
        }
    }
}

#[derive(Parser)]
#[command(name = "sluice", version, about = "A rate-limiting reverse proxy")]
struct Cli {
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Start the gateway.
    Run {
        /// Configuration file [default: $SLUICE_CONFIG, then config/rules.yaml]
        #[arg(short, long)]
        config: Option<PathBuf>,
    },
    /// Parse and validate the configuration, print a summary (like `nginx -t`).
    Check {
        /// Configuration file [default: $SLUICE_CONFIG, then config/rules.yaml]
        #[arg(short, long)]
        config: Option<PathBuf>,
    },
    /// Print the JSON Schema of the configuration file (for editors and CI).
    Schema,
    /// Exit 0 when a running sluice's admin listener answers GET /healthz (or
    /// /readyz) with 200, else 1 with a one-line reason: a container health check.
    Health {
        #[command(flatten)]
        admin: AdminArgs,
        /// Ask /readyz (configuration loaded and store answering) instead of /healthz.
        #[arg(long)]
        ready: bool,
    },
    /// The instances sharing this gateway's Redis and their decisions per route
    /// (GET /admin/fleet), and whether their configurations agree.
    Fleet {
        #[command(flatten)]
        admin: AdminArgs,
        /// Print the admin API's JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Add, remove or list deny-list entries through the admin API.
    Deny {
        #[command(flatten)]
        admin: AdminArgs,
        #[command(subcommand)]
        action: DenyAction,
    },
    /// The most refused clients of the last 60 to 120 seconds, through the admin API.
    Top {
        #[command(flatten)]
        admin: AdminArgs,
        /// Only this route's [default: every route's]
        #[arg(long, value_name = "R")]
        route: Option<String>,
        /// How many rows, from 1 to 1000 [default: 20]
        #[arg(short = 'n', value_name = "N")]
        n: Option<u64>,
        /// Every live instance's list summed (Redis store), not this instance's.
        #[arg(long)]
        fleet: bool,
        /// Print the admin API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Where `sluice deny`, `sluice top` and `sluice health` find the admin API; their
/// token comes from `SLUICE_ADMIN_TOKEN`, else from the configuration's
/// `admin.token` (health needs none).
#[derive(Args)]
struct AdminArgs {
    /// Configuration file with admin.listen and admin.token [default: $SLUICE_CONFIG, then config/rules.yaml]
    #[arg(short, long, value_name = "FILE", global = true)]
    config: Option<PathBuf>,
    /// Admin API URL, e.g. http://127.0.0.1:9091 [default: the configuration's admin.listen]
    #[arg(long, value_name = "URL", global = true)]
    admin: Option<String>,
}

#[derive(Subcommand)]
enum DenyAction {
    /// Deny a client key or an address or block, for a time or until removed.
    Add {
        #[command(flatten)]
        target: TargetArgs,
        /// How long the entry lasts, e.g. 10m, 1h, 1d [default: until removed]
        #[arg(long, value_name = "D", value_parser = admin_api::parse_ttl)]
        ttl: Option<Ttl>,
        /// Why, shown by `sluice deny list`.
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        /// Allow a block wider than /8 (IPv4) or /32 (IPv6), which the API refuses
        /// otherwise.
        #[arg(long)]
        force: bool,
    },
    /// Remove an entry added through the admin API.
    Remove {
        #[command(flatten)]
        target: TargetArgs,
    },
    /// List every entry: static, added and banned (every page of the API).
    List {
        /// Print the admin API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
#[group(required = true, multiple = false)]
struct TargetArgs {
    /// A client key.
    #[arg(long, value_name = "K", value_parser = admin_api::parse_key)]
    key: Option<Target>,
    /// An address or CIDR block, e.g. 203.0.113.7 or 10.1.0.0/16.
    #[arg(long, value_name = "ADDR[/LEN]", value_parser = admin_api::parse_ip)]
    ip: Option<Target>,
}

impl TargetArgs {
    fn target(self) -> Target {
        // clap's group makes exactly one of the two present.
        self.key
            .or(self.ip)
            .unwrap_or_else(|| unreachable!("clap requires --key or --ip"))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Check { config } => check(config.unwrap_or_else(sluice::config::default_path)),
        Command::Run { config } => run(config.unwrap_or_else(sluice::config::default_path)),
        Command::Schema => {
            print!("{}", sluice::config::json_schema());
            ExitCode::SUCCESS
        }
        Command::Deny { admin, action } => deny(admin, action),
        Command::Fleet { admin, json } => fleet(admin, json),
        Command::Health { admin, ready } => health(admin, ready),
        Command::Top {
            admin,
            route,
            n,
            fleet,
            json,
        } => top(admin, route, n, fleet, json),
    }
}

/// The log on stderr: `SLUICE_LOG` filters every line; the access log's lines
/// (`sluice::access`) are written as they are, every other line in `format`.
fn init_logging(format: LogFormat) {
    use sluice::telemetry::access_log::{AccessLayer, TARGET};
    use tracing_subscriber::filter::filter_fn;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = EnvFilter::try_from_env("SLUICE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let not_access = filter_fn(|m| m.target() != TARGET);
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let fmt = match format {
        LogFormat::Text => fmt.with_filter(not_access).boxed(),
        LogFormat::Json => fmt.json().with_filter(not_access).boxed(),
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(AccessLayer)
        .init();
}

fn check(path: PathBuf) -> ExitCode {
    match sluice::config::load(&path) {
        Ok(loaded) => {
            for w in &loaded.warnings {
                eprintln!("{w}");
            }
            print!("{}", sluice::config::summary::summary(&loaded));
            // Envoy's rate limit service's files, checked as `run` reads them.
            if let Some(rls) = &loaded.file.rls {
                let dir = PathBuf::from(rls.config_dir.as_str());
                match sluice::rls::load_dir(&dir) {
                    Ok(domains) => print!("{}", sluice::rls::summary(rls, &domains)),
                    Err(errors) => {
                        eprintln!("{errors}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::FAILURE
        }
    }
}

fn run(path: PathBuf) -> ExitCode {
    let loaded = match sluice::config::load(&path) {
        Ok(l) => l,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::FAILURE;
        }
    };
    raise_open_files();
    // The main thread is worker 0 (with the admin port and the control loop); the
    // server starts the other workers, each a thread with its own runtime.
    let Some(rt) = runtime("sluice run") else {
        return ExitCode::FAILURE;
    };
    rt.block_on(async move {
        // Before anything listens: a signal sent as soon as /healthz answers must
        // find its handler, not the default action (death by the signal).
        let signals = match Signals::install() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("signal handling: {e}");
                return ExitCode::FAILURE;
            }
        };
        let running = match sluice::server::start(loaded).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        };
        signals.wait(&running).await;
        tracing::info!("shutting down: no new connections, waiting for requests in flight");
        running.shutdown().await;
        tracing::info!("stopped");
        ExitCode::SUCCESS
    })
}

fn deny(args: AdminArgs, action: DenyAction) -> ExitCode {
    let action = match action {
        DenyAction::Add {
            target,
            ttl,
            reason,
            force,
        } => Action::Add {
            target: target.target(),
            ttl,
            reason,
            force,
        },
        DenyAction::Remove { target } => Action::Remove {
            target: target.target(),
        },
        DenyAction::List { json } => Action::List { json },
    };
    let config = args.config.unwrap_or_else(sluice::config::default_path);
    let token = std::env::var(admin_api::TOKEN_ENV).ok();
    let Some(rt) = runtime("sluice deny") else {
        return ExitCode::FAILURE;
    };
    let result = rt.block_on(async {
        let endpoint = Endpoint::resolve(args.admin.as_deref(), &config, token)?;
        admin_api::run(&endpoint, &action).await
    });
    match result {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice deny: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice top`: the admin API's `/admin/top`, found and authenticated as `sluice
/// deny` does.
fn top(
    args: AdminArgs,
    route: Option<String>,
    n: Option<u64>,
    fleet: bool,
    json: bool,
) -> ExitCode {
    let config = args.config.unwrap_or_else(sluice::config::default_path);
    let token = std::env::var(admin_api::TOKEN_ENV).ok();
    let Some(rt) = runtime("sluice top") else {
        return ExitCode::FAILURE;
    };
    let result = rt.block_on(async {
        let endpoint = Endpoint::resolve(args.admin.as_deref(), &config, token)?;
        admin_api::top(&endpoint, route.as_deref(), n, fleet, json).await
    });
    match result {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice top: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice fleet`: GET /admin/fleet, found and authorized as `sluice deny` is.
fn fleet(args: AdminArgs, json: bool) -> ExitCode {
    let config = args.config.unwrap_or_else(sluice::config::default_path);
    let token = std::env::var(admin_api::TOKEN_ENV).ok();
    let Some(rt) = runtime("sluice fleet") else {
        return ExitCode::FAILURE;
    };
    let result = rt.block_on(async {
        let endpoint = Endpoint::resolve(args.admin.as_deref(), &config, token)?;
        endpoint.fleet().await
    });
    match result {
        Ok((_, text)) if json => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Ok((v, _)) => {
            print!("{}", admin_api::fleet_text(&v));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice fleet: {e}");
            ExitCode::FAILURE
        }
    }
}

/// How long `sluice health` waits for the answer, connecting included: below the
/// Docker image's HEALTHCHECK timeout, so a hung listener is reported by this
/// command, not by Docker killing it.
const HEALTH_BOUND: std::time::Duration = std::time::Duration::from_secs(3);

/// `sluice health`: GET /healthz (or /readyz) on the admin listener found as
/// `sluice deny` finds it; 200 is success, anything else or no answer a failure.
fn health(args: AdminArgs, ready: bool) -> ExitCode {
    let path = if ready { "/readyz" } else { "/healthz" };
    let config = args.config.unwrap_or_else(sluice::config::default_path);
    let Some(rt) = runtime("sluice health") else {
        return ExitCode::FAILURE;
    };
    let result = rt.block_on(async {
        let endpoint = Endpoint::resolve_listener(args.admin.as_deref(), &config)?;
        let (status, line) = endpoint.get(path, HEALTH_BOUND).await?;
        Ok::<_, admin_api::ClientError>((format!("{}{path}", endpoint.base), status, line))
    });
    match result {
        Ok((url, status, _)) if status == http::StatusCode::OK => {
            println!("{url}: {status}");
            ExitCode::SUCCESS
        }
        Ok((url, status, line)) => {
            let line = if line.is_empty() {
                String::new()
            } else {
                format!(": {line}")
            };
            eprintln!("sluice health: {url} answered {status}{line}");
            ExitCode::FAILURE
        }
        Err(e) => {
            // One line: the configuration error's hint, if any, is left out.
            let text = e.to_string();
            eprintln!("sluice health: {}", text.lines().next().unwrap_or(""));
            ExitCode::FAILURE
        }
    }
}

/// A runtime on this thread, or `None` with the reason on stderr.
fn runtime(command: &str) -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("{command}: cannot start the runtime: {e}");
            None
        }
    }
}

/// Every client connection and every upstream connection is a file descriptor:
/// raise the soft limit on them to the hard limit, as nginx's
/// `worker_rlimit_nofile` or systemd's `LimitNOFILE` would.
fn raise_open_files() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot read the open-file limit");
        return;
    }
    let before = lim.rlim_cur;
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), soft = before, hard = lim.rlim_max, "cannot raise the open-file limit");
            return;
        }
    }
    tracing::debug!(
        soft = lim.rlim_cur,
        hard = lim.rlim_max,
        was = before,
        "open-file limit"
    );
}

/// SIGTERM, SIGINT, SIGHUP and SIGUSR1, caught from `install` on.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }

    /// Reload on SIGHUP, reopen the access log file on SIGUSR1; return on SIGTERM
    /// or SIGINT.
    async fn wait(mut self, running: &sluice::server::Running) {
        loop {
            tokio::select! {
                _ = self.term.recv() => return,
                _ = self.int.recv() => return,
                _ = self.hup.recv() => { let _ = running.reload().await; }
                _ = self.usr1.recv() => running.reopen_logs().await,
            }
        }
    }
}
