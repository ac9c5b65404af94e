//! TEMPORARY stub until the config-validate branch lands.
pub fn summary(loaded: &super::Loaded) -> String {
    format!("{}: ok\n", loaded.path.display())
}
