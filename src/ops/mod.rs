//! Operating a running gateway: the control loop (reloads, deny list, bans), the
//! admin API with its dashboard, the stats history, and the fleet view.

pub mod admin;
pub mod control;
pub mod fleet;
pub mod stats;
