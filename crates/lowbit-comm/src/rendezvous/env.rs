//! The world of one process as `torchrun` describes it in the environment, and the exchange
//! that rank 0 serves and the other ranks fetch.

use std::time::Duration;

use super::{RendezvousError, RendezvousServer, Result, fetch};

/// The world of one process, read from the environment as `torchrun` sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// `RANK`: this process's rank in the world.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes (one per GPU).
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's GPU on its host (default: `RANK`).
    pub local_rank: usize,
    /// `MASTER_ADDR`: rank 0's host (default `127.0.0.1`).
    pub master_addr: String,
    /// The port rank 0 listens on: `LOWBIT_RDZV_PORT` if set; else `MASTER_PORT + 1` under a
    /// torchrun agent that holds `MASTER_PORT` itself (`TORCHELASTIC_USE_AGENT_STORE=True`);
    /// else `MASTER_PORT`.
    pub port: u16,
}

impl RendezvousEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (for tests and launchers that hold them elsewhere).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let number = |name: &str| -> Result<Option<u64>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
                    RendezvousError::Env(format!("{name}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let required = |name: &str| -> Result<u64> {
            number(name)?.ok_or_else(|| RendezvousError::Env(format!("{name} is not set")))
        };
        let to_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let rank = to_usize(required("RANK")?);
        let world_size = to_usize(required("WORLD_SIZE")?);
        if world_size == 0 || rank >= world_size {
            return Err(RendezvousError::BadRank {
                rank,
                world: world_size,
            });
        }
        let local_rank = number("LOCAL_RANK")?.map_or(rank, to_usize);
        let master_addr = get("MASTER_ADDR")
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| "127.0.0.1".to_string());
        let port_of = |name: &str, v: u64| {
            u16::try_from(v)
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| RendezvousError::Env(format!("{name}={v} is not a TCP port")))
        };
        let port = if let Some(p) = number("LOWBIT_RDZV_PORT")? {
            port_of("LOWBIT_RDZV_PORT", p)?
        } else {
            let p = port_of("MASTER_PORT", required("MASTER_PORT")?)?;
            let agent = get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True");
            if agent {
                p.checked_add(1).ok_or_else(|| {
                    RendezvousError::Env(format!(
                        "MASTER_PORT={p}: no port above it for the rendezvous (set LOWBIT_RDZV_PORT)"
                    ))
                })?
            } else {
                p
            }
        };
        Ok(RendezvousEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            port,
        })
    }

    /// `host:port` of rank 0 (IPv6 literals bracketed).
    pub fn server_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.port)
        } else {
            format!("{}:{}", self.master_addr, self.port)
        }
    }

    /// Rank 0 serves `payload()` to the others; the others fetch it. Returns the payload on every
    /// rank. `payload` runs on rank 0 only, after it listens.
    pub fn exchange(
        &self,
        payload: impl FnOnce() -> Result<Vec<u8>>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        if self.rank == 0 {
            let server = RendezvousServer::bind(("0.0.0.0", self.port))?;
            let bytes = payload()?;
            server.serve(self.world_size, &bytes, timeout)?;
            Ok(bytes)
        } else {
            fetch(&self.server_addr(), self.rank, self.world_size, timeout)
        }
    }
}
