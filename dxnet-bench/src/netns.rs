//! N nodes on one machine as if on separate hosts: one network namespace per
//! node, each with an `eth0` veth whose peer sits on a bridge inside a
//! separate "switch" namespace (the host's own namespace is left untouched).
//! Node `i` gets 10.201.0.(i+1)/24. Needs root (`ip netns`).
//!
//! The control channel is a Unix socket, which reaches into the namespaces
//! through the file system, so it neither needs a route nor shows up in the
//! counters of `eth0`, whose `tx_bytes` give the wire bytes.

use std::process::Command;

use anyhow::{bail, Context, Result};

/// The namespaces of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Name prefix: namespaces `{prefix}{i}` and `{prefix}-sw`.
    pub prefix: String,
    /// Number of node namespaces.
    pub nodes: usize,
    /// MTU of the veth links.
    pub mtu: u32,
}

impl Layout {
    /// A layout of `nodes` namespaces named after `prefix`.
    pub fn new(prefix: &str, nodes: usize, mtu: u32) -> Self {
        Layout {
            prefix: prefix.to_string(),
            nodes,
            mtu,
        }
    }

    /// The namespace of node `i`.
    pub fn namespace(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }

    /// The switch namespace holding the bridge.
    pub fn switch(&self) -> String {
        format!("{}-sw", self.prefix)
    }

    /// The address of node `i`.
    pub fn address(&self, i: usize) -> String {
        format!("10.201.0.{}", i + 1)
    }

    /// Creates the namespaces, veth pairs and bridge (removing leftovers of
    /// an earlier run first).
    pub fn setup(&self) -> Result<()> {
        if self.nodes == 0 || self.nodes > 250 {
            bail!("netns: 1..=250 nodes supported");
        }
        self.teardown();
        let sw = self.switch();
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        let mtu = self.mtu.to_string();
        for i in 0..self.nodes {
            let ns = self.namespace(i);
            let v = format!("v{i}");
            ip(&["netns", "add", &ns])?;
            ip(&[
                "-n", &sw, "link", "add", &v, "mtu", &mtu, "type", "veth", "peer", "name", "eth0",
                "mtu", &mtu, "netns", &ns,
            ])?;
            ip(&["-n", &sw, "link", "set", &v, "master", "br0", "up"])?;
            let cidr = format!("{}/24", self.address(i));
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    /// Removes everything [`Layout::setup`] created; errors are ignored.
    pub fn teardown(&self) {
        for i in 0..self.nodes.max(1).max(64) {
            let ns = self.namespace(i);
            if std::path::Path::new("/run/netns").join(&ns).exists() {
                let _ = ip(&["netns", "del", &ns]);
            }
        }
        let sw = self.switch();
        if std::path::Path::new("/run/netns").join(&sw).exists() {
            let _ = ip(&["netns", "del", &sw]);
        }
    }
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("cannot run `ip` (iproute2)")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Tears the layout down when dropped (also on errors and panics).
pub struct Guard(pub Layout);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_addresses() {
        let l = Layout::new("dxb", 4, 1500);
        assert_eq!(l.namespace(3), "dxb3");
        assert_eq!(l.switch(), "dxb-sw");
        assert_eq!(l.address(0), "10.201.0.1");
        assert_eq!(l.address(7), "10.201.0.8");
    }
}
