//! The `sluice` command line: parse arguments, set up logging, call the library.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Check { config } => check(config.unwrap_or_else(sluice::config::default_path)),
        Command::Run { config } => run(config.unwrap_or_else(sluice::config::default_path)),
    }
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_env("SLUICE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn check(path: PathBuf) -> ExitCode {
    match sluice::config::load(&path) {
        Ok(loaded) => {
            print!("{}", sluice::config::summary::summary(&loaded));
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
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let running = match sluice::server::start(loaded).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = wait_for_signals(&running).await {
            eprintln!("signal handling: {e}");
        }
        tracing::info!("shutting down: no new connections, waiting for requests in flight");
        running.shutdown().await;
        tracing::info!("stopped");
        ExitCode::SUCCESS
    })
}

/// Reload on SIGHUP; return on SIGTERM or SIGINT.
async fn wait_for_signals(running: &sluice::server::Running) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
            _ = hup.recv() => { let _ = running.reload().await; }
        }
    }
}
