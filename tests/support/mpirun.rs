//! Waiting for `mpirun` jobs in tests, bounded.
//!
//! Open MPI 4.1's `mpirun` can deadlock in its own shutdown (`orte_finalize` ->
//! `PMIx_server_finalize`, a mutex never released) after a rank dies during start-up: every rank
//! has exited (zombies of `mpirun`) and `mpirun` never returns. A test that kills ranks must not
//! hang on that, and must not hide a hang of ours either: [`wait_job`] kills an `mpirun` whose
//! ranks have all been gone for a while (the job has failed, as a scheduler would see it) and fails
//! the test, after killing everything, when ranks are still running past the limit. (Seen here
//! about once in ten chaos runs, always after a kill during start-up.)

use std::io::Read;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// The children of `parent` with their state letter (`R`, `S`, `Z`, ...), by pid.
pub fn children_with_state(parent: u32) -> Vec<(u32, char)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // `pid (comm) state ppid ...`: the command may hold spaces, so read after the last ')'.
        let mut rest = stat.rsplit(')').next().unwrap_or("").split_whitespace();
        let state = rest.next().and_then(|s| s.chars().next());
        let ppid = rest.next().and_then(|p| p.parse::<u32>().ok());
        if let (Some(state), Some(ppid)) = (state, ppid) {
            if ppid == parent {
                out.push((pid, state));
            }
        }
    }
    out.sort_unstable();
    out
}

/// The children of `parent`, by pid.
#[allow(dead_code)] // not every test file that includes this kills ranks
pub fn children(parent: u32) -> Vec<u32> {
    children_with_state(parent).into_iter().map(|(pid, _)| pid).collect()
}

/// How long an `mpirun` may outlive all its ranks before it counts as stuck in its shutdown (it
/// reaps them and exits within a second or two otherwise).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(15);

/// Waits up to `limit` for `child` (an `mpirun` with piped stdout and stderr) and returns its
/// output. An `mpirun` whose ranks have all exited for [`SHUTDOWN_GRACE`] is killed (its status
/// then says so: killed by a signal); one with ranks still running past `limit` is a hang:
/// everything is killed and the test fails, showing the ranks' states and the output so far.
pub fn wait_job(mut child: Child, limit: Duration) -> Output {
    let pipe = |p: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut p) = p {
                let _ = p.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = pipe(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = pipe(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let t0 = Instant::now();
    let (mut ranks_gone_since, mut ranks_seen): (Option<Instant>, bool) = (None, false);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        let ranks = children_with_state(child.id());
        let running: Vec<_> = ranks.iter().filter(|(_, s)| *s != 'Z' && *s != 'X').collect();
        ranks_seen |= !ranks.is_empty();
        if running.is_empty() && ranks_seen {
            let since = *ranks_gone_since.get_or_insert_with(Instant::now);
            if since.elapsed() > SHUTDOWN_GRACE {
                eprintln!(
                    "mpirun did not return {SHUTDOWN_GRACE:?} after its ranks ended (Open MPI's shutdown \
                     deadlock after a rank's death): killed"
                );
                let _ = child.kill();
                break child.wait().unwrap();
            }
        } else {
            ranks_gone_since = None;
        }
        if t0.elapsed() > limit {
            for (pid, _) in &ranks {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            }
            let _ = child.kill();
            let _ = child.wait();
            let (out, err) = (stdout.join().unwrap(), stderr.join().unwrap());
            panic!(
                "the job hung: ranks still running after {limit:?}: {running:?}\nstderr: {}\nstdout: {}",
                String::from_utf8_lossy(&err),
                String::from_utf8_lossy(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output { status, stdout: stdout.join().unwrap(), stderr: stderr.join().unwrap() }
}
