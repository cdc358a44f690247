//! Disjoint shares of the host's cores for the node processes of one run
//! (`--bind-nodes`): nodes that share a host then do not run on each
//! other's cores, as nodes on separate machines would not. Without it the
//! kernel places every thread of every node on any core, and a node's
//! busy-polling threads can hold the core its peer's threads need.

use anyhow::{bail, Result};

/// The CPUs the calling thread may run on, in ascending order.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: `cpu_set_t` is plain data; zeroed is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: writes at most `size_of::<cpu_set_t>()` bytes into `set`.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        bail!(
            "sched_getaffinity failed: {}",
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: `CPU_ISSET` reads the initialized set within its size.
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    if cpus.is_empty() {
        bail!("this process may run on no CPU");
    }
    Ok(cpus)
}

/// Process `i`'s share of `cpus` among `n` processes: a contiguous run of
/// `cpus.len() / n` or one more CPUs, disjoint from the others' shares;
/// with more processes than CPUs, CPU `i` modulo their number (processes
/// then share CPUs, evenly).
pub fn share(cpus: &[usize], i: usize, n: usize) -> Vec<usize> {
    let len = cpus.len();
    if n <= 1 || len == 0 {
        return cpus.to_vec();
    }
    if n > len {
        return vec![cpus[i % len]];
    }
    cpus[i * len / n..(i + 1) * len / n].to_vec()
}

/// Binds the calling thread to `cpus`; threads it starts afterwards
/// inherit the binding (so a node process calls this before it starts
/// any).
pub fn bind(cpus: &[usize]) -> Result<()> {
    if cpus.is_empty() {
        bail!("no CPUs to bind to");
    }
    // SAFETY: `cpu_set_t` is plain data; zeroed is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= libc::CPU_SETSIZE as usize {
            bail!(
                "CPU {c} is beyond the largest CPU number ({})",
                libc::CPU_SETSIZE - 1
            );
        }
        // SAFETY: `c` is within the set's size (checked above).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: reads `size_of::<cpu_set_t>()` bytes of the initialized set.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        bail!(
            "cannot bind to CPUs {cpus:?}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// `cpus` as the node subcommand's `--cpus` argument (`0,1,2`).
pub fn to_arg(cpus: &[usize]) -> String {
    cpus.iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_disjoint_and_cover_the_cpus() {
        let cpus: Vec<usize> = vec![0, 1, 2, 3, 4, 5, 6];
        for n in 1..=7 {
            let mut all: Vec<usize> = (0..n).flat_map(|i| share(&cpus, i, n)).collect();
            assert!((0..n).all(|i| !share(&cpus, i, n).is_empty()));
            all.sort_unstable();
            assert_eq!(all, cpus, "{n} processes");
        }
        assert_eq!(share(&[0, 1], 0, 2), vec![0]);
        assert_eq!(share(&[0, 1], 1, 2), vec![1]);
        assert_eq!(share(&[2, 5, 7, 9], 1, 2), vec![7, 9]);
    }

    #[test]
    fn more_processes_than_cpus_share_them_evenly() {
        let cpus = [0usize, 1];
        let got: Vec<Vec<usize>> = (0..5).map(|i| share(&cpus, i, 5)).collect();
        assert_eq!(got, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);
    }

    #[test]
    fn a_bound_thread_and_its_children_run_on_the_share() {
        let cpus = allowed_cpus().unwrap();
        let mine = share(&cpus, cpus.len() - 1, cpus.len());
        let (own, child) = std::thread::spawn(move || {
            bind(&mine).unwrap();
            let own = allowed_cpus().unwrap();
            let child = std::thread::spawn(|| allowed_cpus().unwrap())
                .join()
                .unwrap();
            (own, child)
        })
        .join()
        .unwrap();
        assert_eq!(own, vec![*cpus.last().unwrap()]);
        assert_eq!(child, own);
        assert!(bind(&[]).is_err());
        assert!(bind(&[libc::CPU_SETSIZE as usize]).is_err());
    }
}
