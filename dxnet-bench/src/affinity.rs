//! Disjoint shares of the host's cores for the node processes of one run
//! (`--bind-nodes`): nodes that share a host then do not run on each
//! other's cores, as nodes on separate machines would not. Without it the
//! kernel places every thread of every node on any core, and a node's
//! busy-polling threads can hold the core its peer's threads need. Shares
//! are whole physical cores (a core's hardware threads stay together).

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

/// `cpus` grouped by physical core (the hardware threads of one core
/// together), in order of their first CPU; each CPU alone where the
/// topology is unknown.
pub fn cores_of(cpus: &[usize]) -> Vec<Vec<usize>> {
    group_by_core(cpus, |c| {
        let dir = format!("/sys/devices/system/cpu/cpu{c}/topology");
        let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).ok();
        Some((read("physical_package_id")?, read("core_id")?))
    })
}

/// [`cores_of`] with the core of each CPU from `core` (`None`: unknown).
fn group_by_core<K: PartialEq>(
    cpus: &[usize],
    core: impl Fn(usize) -> Option<K>,
) -> Vec<Vec<usize>> {
    let mut groups: Vec<(Option<K>, Vec<usize>)> = Vec::new();
    for &c in cpus {
        let k = core(c);
        match groups.iter_mut().find(|(g, _)| k.is_some() && *g == k) {
            Some((_, g)) => g.push(c),
            None => groups.push((k, vec![c])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// Process `i`'s share of `cores` (CPUs grouped by core, see [`cores_of`])
/// among `n` processes: a contiguous run of `cores.len() / n` or one more
/// cores, disjoint from the others' shares; with more processes than
/// cores, core `i` modulo their number (processes then share cores,
/// evenly).
pub fn share(cores: &[Vec<usize>], i: usize, n: usize) -> Vec<usize> {
    let len = cores.len();
    let picked = if n <= 1 || len == 0 {
        cores
    } else if n > len {
        std::slice::from_ref(&cores[i % len])
    } else {
        &cores[i * len / n..(i + 1) * len / n]
    };
    picked.iter().flatten().copied().collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn single(cpus: &[usize]) -> Vec<Vec<usize>> {
        cpus.iter().map(|&c| vec![c]).collect()
    }

    #[test]
    fn shares_are_disjoint_and_cover_the_cpus() {
        let cpus: Vec<usize> = vec![0, 1, 2, 3, 4, 5, 6];
        let cores = single(&cpus);
        for n in 1..=7 {
            let mut all: Vec<usize> = (0..n).flat_map(|i| share(&cores, i, n)).collect();
            assert!((0..n).all(|i| !share(&cores, i, n).is_empty()));
            all.sort_unstable();
            assert_eq!(all, cpus, "{n} processes");
        }
        assert_eq!(share(&single(&[0, 1]), 0, 2), vec![0]);
        assert_eq!(share(&single(&[0, 1]), 1, 2), vec![1]);
        assert_eq!(share(&single(&[2, 5, 7, 9]), 1, 2), vec![7, 9]);
    }

    #[test]
    fn more_processes_than_cpus_share_them_evenly() {
        let cores = single(&[0, 1]);
        let got: Vec<Vec<usize>> = (0..5).map(|i| share(&cores, i, 5)).collect();
        assert_eq!(got, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);
    }

    #[test]
    fn hardware_threads_of_a_core_stay_in_one_share() {
        // Linux numbers the second thread of each core after the first
        // ones: CPUs 0-3 are cores 0-3, CPUs 4-7 their twins.
        let cpus: Vec<usize> = (0..8).collect();
        let cores = group_by_core(&cpus, |c| Some(c % 4));
        assert_eq!(cores, vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        assert_eq!(share(&cores, 0, 2), vec![0, 4, 1, 5]);
        assert_eq!(share(&cores, 1, 2), vec![2, 6, 3, 7]);
        // Unknown topology: every CPU a core of its own.
        assert_eq!(group_by_core(&[3, 4], |_| None::<u32>), single(&[3, 4]));
        // This host's CPUs all land in some core, once.
        let here = allowed_cpus().unwrap();
        let mut all: Vec<usize> = cores_of(&here).into_iter().flatten().collect();
        all.sort_unstable();
        assert_eq!(all, here);
    }

    #[test]
    fn a_bound_thread_and_its_children_run_on_the_share() {
        let cpus = allowed_cpus().unwrap();
        let mine = vec![*cpus.last().unwrap()];
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
