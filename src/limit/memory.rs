//! The embedded store: limiter state in process, bounded and swept.
pub struct MemoryStore;
// TEMPORARY stub until the limit-algos branch lands.
impl MemoryStore {
    pub fn new(_max_keys: usize, _clock: std::sync::Arc<dyn super::Clock>) -> MemoryStore { MemoryStore }
    pub fn check(&self, _route: &str, _key: &str, plan: &super::Plan) -> super::Verdict {
        super::Verdict { allowed: true, delay_us: 0, outcomes: vec![Default::default(); plan.limits.len()] }
    }
    pub fn sweep(&self) -> usize { 0 }
}
