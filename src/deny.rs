//! The deny list: addresses, CIDR blocks and client keys that are refused before
//! any limit is charged. The static part comes from `deny:` in the configuration;
//! entries added through the admin API and automatic bans join it in later layers
//! that answer the same two questions.

use std::collections::HashSet;
use std::net::IpAddr;

use http::StatusCode;
use ipnet::IpNet;

#[derive(Debug, Clone)]
pub struct DenyList {
    /// Single addresses, looked up in O(1).
    addrs: HashSet<IpAddr>,
    /// Real blocks (shorter than a host prefix).
    nets: Vec<IpNet>,
    keys: HashSet<String>,
    pub status: StatusCode,
}

impl DenyList {
    pub fn new(
        entries: impl IntoIterator<Item = IpNet>,
        keys: impl IntoIterator<Item = String>,
        status: StatusCode,
    ) -> DenyList {
        let mut addrs = HashSet::new();
        let mut nets = Vec::new();
        for n in entries {
            if n.prefix_len() == n.max_prefix_len() {
                addrs.insert(n.addr());
            } else {
                nets.push(n);
            }
        }
        DenyList {
            addrs,
            nets,
            keys: keys.into_iter().collect(),
            status,
        }
    }

    pub fn ip(&self, ip: IpAddr) -> bool {
        self.addrs.contains(&ip) || self.nets.iter().any(|n| n.contains(&ip))
    }

    pub fn key(&self, key: &str) -> bool {
        !self.keys.is_empty() && self.keys.contains(key)
    }

    pub fn ip_entries(&self) -> usize {
        self.addrs.len() + self.nets.len()
    }

    pub fn key_entries(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_blocks_and_keys() {
        let d = DenyList::new(
            [
                "203.0.113.0/24".parse().unwrap(),
                "198.51.100.7/32".parse().unwrap(),
                "2001:db8::/32".parse().unwrap(),
            ],
            ["leaked".to_string()],
            StatusCode::FORBIDDEN,
        );
        for (ip, denied) in [
            ("203.0.113.200", true),
            ("203.0.114.1", false),
            ("198.51.100.7", true),
            ("198.51.100.8", false),
            ("2001:db8:1::5", true),
            ("2001:db9::1", false),
        ] {
            assert_eq!(d.ip(ip.parse().unwrap()), denied, "{ip}");
        }
        assert!(d.key("leaked"));
        assert!(!d.key("leaked2"));
        assert_eq!((d.ip_entries(), d.key_entries()), (3, 1));
    }
}
