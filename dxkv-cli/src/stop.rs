//! When a long-running command stops: on SIGTERM or SIGINT (how systemd,
//! Kubernetes, Slurm and a terminal end a service), or, only when asked,
//! when standard input ends (how `dxkv local` and a launcher's remote shell
//! end their nodes). Standard input is otherwise left alone, so a node
//! runs under `nohup`, `&` or a container without `-i`.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Why the command stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM or SIGINT (its number).
    Signal(i32),
    /// Standard input ended (with `--stop-on-stdin-eof`).
    StdinClosed,
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Signal(SIGTERM) => f.write_str("SIGTERM"),
            Stop::Signal(SIGINT) => f.write_str("SIGINT"),
            Stop::Signal(n) => write!(f, "signal {n}"),
            Stop::StdinClosed => f.write_str("standard input closed"),
        }
    }
}

/// The stop requests of this process, installed before it starts serving
/// (a signal that arrives earlier is not lost: it is queued).
pub struct StopRequests {
    rx: Receiver<Stop>,
}

impl StopRequests {
    /// Catches SIGTERM and SIGINT from now on, and watches standard input
    /// if `on_stdin_eof`.
    pub fn install(on_stdin_eof: bool) -> Result<Self, String> {
        let (tx, rx) = channel();
        let mut signals =
            Signals::new([SIGTERM, SIGINT]).map_err(|e| format!("catching signals: {e}"))?;
        let to = tx.clone();
        std::thread::Builder::new()
            .name("dxkv-signals".into())
            .spawn(move || {
                for s in signals.forever() {
                    if to.send(Stop::Signal(s)).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        if on_stdin_eof {
            std::thread::Builder::new()
                .name("dxkv-stdin".into())
                .spawn(move || {
                    let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
                    let _ = tx.send(Stop::StdinClosed);
                })
                .map_err(|e| e.to_string())?;
        }
        Ok(Self { rx })
    }

    /// Blocks until the first stop request.
    pub fn wait(&self) -> Stop {
        // Both senders live as long as the process serves.
        self.rx.recv().unwrap_or(Stop::StdinClosed)
    }

    /// Bounds the orderly shutdown that follows: a second signal, or
    /// `timeout` passing, ends the process at once with exit code 1.
    pub fn bound_shutdown(self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        std::thread::Builder::new()
            .name("dxkv-shutdown-bound".into())
            .spawn(move || loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let why = match self.rx.recv_timeout(left) {
                    Ok(Stop::Signal(s)) => format!("{}: stopping at once", Stop::Signal(s)),
                    // Stdin ending meanwhile is no second request.
                    Ok(Stop::StdinClosed) => continue,
                    Err(RecvTimeoutError::Timeout) => {
                        format!("shutdown not done within {timeout:?}: stopping at once")
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                };
                eprintln!("dxkv: {why}");
                std::process::exit(1);
            })
            .expect("spawning the shutdown bound");
    }
}
