//! Counts of what each client address holds (gateway and admin connections,
//! upstream connections taken by uploads still streaming), each under a cap: one
//! address cannot take every slot of something all clients share.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// How many slots each address holds.
#[derive(Default)]
pub struct PerIp(Mutex<HashMap<IpAddr, usize>>);

/// One slot of an address, given back when dropped.
pub struct IpSlot {
    table: Arc<PerIp>,
    ip: IpAddr,
}

impl PerIp {
    /// A slot for `ip`, or `None` when it already holds `cap`.
    pub fn take(table: &Arc<PerIp>, ip: IpAddr, cap: usize) -> Option<IpSlot> {
        let mut t = lock(table);
        let n = t.entry(ip).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(IpSlot {
            table: table.clone(),
            ip,
        })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut t = lock(&self.table);
        if let Some(n) = t.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                t.remove(&self.ip);
            }
        }
    }
}

fn lock(t: &PerIp) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
    t.0.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_holds_at_most_its_cap_and_gets_slots_back() {
        let t = Arc::new(PerIp::default());
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.2".parse().unwrap(), "::1".parse().unwrap());
        let first = PerIp::take(&t, a, 2).unwrap();
        let _second = PerIp::take(&t, a, 2).unwrap();
        assert!(PerIp::take(&t, a, 2).is_none());
        let _other = PerIp::take(&t, b, 2).unwrap();
        drop(first);
        assert!(PerIp::take(&t, a, 2).is_some());
    }
}
