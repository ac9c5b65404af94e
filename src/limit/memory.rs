//! The embedded store: limiter state in process, bounded and swept.
pub struct MemoryStore;
