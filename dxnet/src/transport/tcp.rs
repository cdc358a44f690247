//! TCP transport (being written).
use std::sync::Arc;
use crate::core::Core;
use crate::transport::Transport;
use crate::{Error, Result};
/// Starts the TCP engine.
pub fn start(_core: &Arc<Core>) -> Result<Arc<dyn Transport>> { Err(Error::Transport("tcp not yet".into())) }
