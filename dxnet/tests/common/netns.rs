//! N network namespaces on a bridge (in a separate "switch" namespace), as
//! if N hosts: namespace `{prefix}{i}` has `eth0` with 10.202.0.(i+1)/24.
//! Needs root and `ip`; [`Star::create`] says why when it cannot.

use std::process::Command;

/// Runs `ip ARGS`; the error carries its stderr.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces; deleted on drop.
pub struct Star {
    prefix: String,
    n: usize,
}

impl Star {
    /// Creates `n` namespaces on a bridge.
    pub fn create(tag: &str, n: usize) -> Result<Self, String> {
        let s = Star {
            prefix: format!("{tag}{}-", std::process::id() % 100_000),
            n,
        };
        let sw = s.switch();
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = s.namespace(i);
            let v = format!("v{i}");
            ip(&["netns", "add", &ns])?;
            ip(&[
                "-n", &sw, "link", "add", &v, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["-n", &sw, "link", "set", &v, "master", "br0", "up"])?;
            let cidr = format!("{}/24", s.ip(i));
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(s)
    }

    /// Namespace of node `i`.
    pub fn namespace(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }

    fn switch(&self) -> String {
        format!("{}sw", self.prefix)
    }

    /// IP address of node `i`.
    pub fn ip(&self, i: usize) -> String {
        format!("10.202.0.{}", i + 1)
    }
}

impl Drop for Star {
    fn drop(&mut self) {
        for i in 0..self.n {
            let _ = ip(&["netns", "del", &self.namespace(i)]);
        }
        let _ = ip(&["netns", "del", &self.switch()]);
    }
}
