//! The host lists launchers hand out: Slurm's compressed host lists
//! (`node[01-03,7],gpu1`) and tasks per node (`2(x3),1`), and MPI host
//! files (`host slots=4`, `host:4`). Pure text in, hosts out.

/// One host of a list with the number of ranks it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slots {
    /// Host name or address, with `:port` if the list gave one.
    pub host: String,
    /// Ranks placed on it.
    pub slots: usize,
}

/// Most hosts a list may expand to (node ids are 16-bit).
const MAX_HOSTS: usize = 1 << 16;

/// Expands a Slurm-style host list: comma-separated entries, each with any
/// number of bracketed ranges (`n[1-3,5]`, `rack[1-2]-n[01-02]`); zero
/// padding is kept (`[08-10]` gives `08, 09, 10`).
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for entry in split_top(list)? {
        let entry = entry.trim();
        if entry.is_empty() {
            continue;
        }
        let mut partial = vec![String::new()];
        let mut rest = entry;
        while let Some(open) = rest.find('[') {
            let close = rest[open..]
                .find(']')
                .map(|c| open + c)
                .ok_or_else(|| format!("host list: unclosed '[' in {entry:?}"))?;
            let prefix = &rest[..open];
            let ranges = ranges(&rest[open + 1..close], entry)?;
            let mut next = Vec::with_capacity(partial.len() * ranges.len());
            for p in &partial {
                for r in &ranges {
                    next.push(format!("{p}{prefix}{r}"));
                }
            }
            if next.len() > MAX_HOSTS {
                return Err(format!("host list: {entry:?} expands to too many hosts"));
            }
            partial = next;
            rest = &rest[close + 1..];
        }
        if rest.contains(']') {
            return Err(format!("host list: unmatched ']' in {entry:?}"));
        }
        hosts.extend(partial.into_iter().map(|p| format!("{p}{rest}")));
        if hosts.len() > MAX_HOSTS {
            return Err("host list: too many hosts".into());
        }
    }
    Ok(hosts)
}

/// `list` split at the commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let (mut depth, mut start, mut parts) = (0usize, 0, Vec::new());
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("host list: unmatched ']' in {list:?}"))?
            }
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    Ok(parts)
}

/// The values of one bracket (`01-03,7`), zero padding kept.
fn ranges(body: &str, entry: &str) -> Result<Vec<String>, String> {
    let bad = || format!("host list: bad range [{body}] in {entry:?}");
    let mut out = Vec::new();
    for part in body.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(bad());
        }
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| bad())?,
            hi.parse().map_err(|_| bad())?,
        );
        if a > b || b - a >= MAX_HOSTS as u64 {
            return Err(bad());
        }
        let width = lo.len();
        out.extend((a..=b).map(|v| format!("{v:0width$}")));
        if out.len() > MAX_HOSTS {
            return Err(bad());
        }
    }
    Ok(out)
}

/// Expands Slurm's tasks per node (`SLURM_TASKS_PER_NODE`: `2(x3),1` is
/// 2, 2, 2, 1).
pub fn tasks_per_node(spec: &str) -> Result<Vec<usize>, String> {
    let bad = || format!("tasks per node: cannot read {spec:?}");
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (n, times) = match part.split_once("(x") {
            Some((n, t)) => (n, t.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let n: usize = n.parse().map_err(|_| bad())?;
        let times: usize = times.parse().map_err(|_| bad())?;
        if times > MAX_HOSTS || out.len() + times > MAX_HOSTS {
            return Err(bad());
        }
        out.extend(std::iter::repeat_n(n, times));
    }
    Ok(out)
}

/// Reads an MPI host file: one host per line, `host`, `host slots=N`
/// (Open MPI) or `host:N` (MPICH); `#` starts a comment. A host without a
/// count runs one rank.
pub fn host_file(text: &str) -> Result<Vec<Slots>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| format!("host file line {}: {why}: {line:?}", n + 1);
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        let mut slots = None;
        for w in words {
            match w.split_once('=') {
                Some(("slots", v)) => slots = Some(v.parse().map_err(|_| bad("bad slots"))?),
                // Other Open MPI keys (max_slots, ...) do not place ranks.
                Some(_) => {}
                None => return Err(bad("unexpected word")),
            }
        }
        let host = match (first.rsplit_once(':'), slots) {
            (Some((h, count)), None) if !h.contains(':') || h.ends_with(']') => {
                slots = Some(count.parse().map_err(|_| bad("bad count after ':'"))?);
                h
            }
            _ => first,
        };
        let slots = slots.unwrap_or(1);
        if slots == 0 {
            return Err(bad("no slots"));
        }
        out.push(Slots {
            host: host.to_string(),
            slots,
        });
        if out.len() > MAX_HOSTS {
            return Err("host file: too many hosts".into());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_host_lists() {
        assert_eq!(expand("a,b").unwrap(), ["a", "b"]);
        assert_eq!(
            expand("n[08-10,3],gpu1").unwrap(),
            ["n08", "n09", "n10", "n3", "gpu1"]
        );
        assert_eq!(
            expand("r[1-2]-n[1-2].x").unwrap(),
            ["r1-n1.x", "r1-n2.x", "r2-n1.x", "r2-n2.x"]
        );
        assert_eq!(expand("").unwrap(), Vec::<String>::new());
        for bad in ["n[1-", "n[3-1]", "n[a]", "n]1", "n[1-70000]", "n[]"] {
            assert!(expand(bad).is_err(), "{bad}");
        }
        // A product beyond 16-bit ids is refused, not allocated.
        assert!(expand("a[0-999][0-999]").is_err());
    }

    #[test]
    fn slurm_tasks_per_node() {
        assert_eq!(tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(tasks_per_node("4").unwrap(), [4]);
        for bad in ["x", "2(x", "2(x3", "2(xa)", "1(x999999)"] {
            assert!(tasks_per_node(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn mpi_host_files() {
        let f = "# cluster\nh1 slots=2\nh2:3\nh3 max_slots=8\n\n[::1]:2\n";
        let s = host_file(f).unwrap();
        let got: Vec<(&str, usize)> = s.iter().map(|s| (s.host.as_str(), s.slots)).collect();
        assert_eq!(got, [("h1", 2), ("h2", 3), ("h3", 1), ("[::1]", 2)]);
        assert!(host_file("h slots=0").is_err());
        assert!(host_file("h slots=x").is_err());
        assert!(host_file("h junk").is_err());
    }
}
