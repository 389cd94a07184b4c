//! The world of one process as `torchrun` describes it in the environment, and the exchange
//! that rank 0 serves and the other ranks fetch.

use std::time::Duration;

use std::net::ToSocketAddrs;

use super::{
    Link, RendezvousError, RendezvousSecret, RendezvousServer, Result, ServeOptions, fetch_link,
    no_secret_hint,
};
use crate::liveness::{Liveness, LivenessConfig, PeerEvent};

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
    /// `LOCAL_WORLD_SIZE`: processes on this host, if the launcher says (a warning when rank 0
    /// listens on loopback only while other hosts take part).
    pub local_world_size: Option<usize>,
    /// `LOWBIT_RDZV_BIND`: the address rank 0 listens on instead of `MASTER_ADDR`'s.
    pub bind: Option<String>,
    /// The job secret: `LOWBIT_RDZV_TOKEN` if set (empty is an error); else
    /// `TORCHELASTIC_RUN_ID` unless unset, empty or `none`; else `None`, which
    /// [`RendezvousEnv::exchange`] accepts on loopback addresses only (with the public default
    /// key and a notice) and refuses otherwise.
    pub secret: Option<RendezvousSecret>,
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
        let local_world_size = number("LOCAL_WORLD_SIZE")?.map(to_usize);
        let bind = get("LOWBIT_RDZV_BIND").filter(|s| !s.trim().is_empty());
        let secret = match get("LOWBIT_RDZV_TOKEN") {
            Some(t) if t.is_empty() => {
                return Err(RendezvousError::Env(
                    "LOWBIT_RDZV_TOKEN is set but empty (unset it, or give every rank the same \
                     random value)"
                        .into(),
                ));
            }
            Some(t) => Some(RendezvousSecret::from_token(t.as_bytes())),
            None => get("TORCHELASTIC_RUN_ID")
                .filter(|id| !id.trim().is_empty() && id.trim() != "none")
                .map(|id| RendezvousSecret::from_run_id(&id)),
        };
        Ok(RendezvousEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            port,
            local_world_size,
            bind,
            secret,
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

    /// The secret to use where the addresses involved are (`loopback`) or are not all loopback.
    pub fn effective_secret(&self, loopback: bool) -> Result<RendezvousSecret> {
        match &self.secret {
            Some(s) => Ok(s.clone()),
            None if loopback => Ok(RendezvousSecret::public()),
            None => Err(RendezvousError::Auth {
                peer: format!("MASTER_ADDR={}", self.master_addr),
                detail: no_secret_hint(),
            }),
        }
    }

    /// Rank 0 serves `payload()` to the others; the others fetch it. Returns the payload on every
    /// rank. `payload` runs on rank 0 only, after it listens. Rank 0 listens on the addresses
    /// `LOWBIT_RDZV_BIND` (else `MASTER_ADDR`) resolves to on this host; see
    /// [`RendezvousEnv::secret`] for the secret.
    pub fn exchange(
        &self,
        payload: impl FnOnce() -> Result<Vec<u8>>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.exchange_inner(payload, timeout, false)
            .map(|(bytes, _)| bytes)
    }

    /// [`RendezvousEnv::exchange`], then the liveness channel over the same authenticated
    /// connections (rank 0 to every other rank): `on_event` hears of every peer that leaves or
    /// is lost (see [`crate::liveness`]). The channel lasts as long as the returned handle; its
    /// drop tells the peers this rank finished.
    pub fn exchange_live(
        &self,
        payload: impl FnOnce() -> Result<Vec<u8>>,
        timeout: Duration,
        config: LivenessConfig,
        on_event: impl Fn(&PeerEvent) + Send + Sync + 'static,
    ) -> Result<(Vec<u8>, Liveness)> {
        let (bytes, links) = self.exchange_inner(payload, timeout, true)?;
        let live = Liveness::start(
            self.rank,
            self.world_size,
            links,
            config,
            timeout,
            Box::new(on_event),
        )
        .map_err(|e| RendezvousError::Io {
            peer: "the liveness channel".into(),
            detail: e.to_string(),
        })?;
        Ok((bytes, live))
    }

    /// The exchange, keeping the connections (`keep`) or closing them.
    fn exchange_inner(
        &self,
        payload: impl FnOnce() -> Result<Vec<u8>>,
        timeout: Duration,
        keep: bool,
    ) -> Result<(Vec<u8>, Vec<Link>)> {
        if self.rank == 0 {
            let host = self.bind.as_deref().unwrap_or(&self.master_addr);
            let server = RendezvousServer::bind_host(host, self.port)?;
            let loopback = server.loopback_only();
            let secret = self.effective_secret(loopback)?;
            if secret.is_public() {
                eprintln!(
                    "lowbit rendezvous: no LOWBIT_RDZV_TOKEN or TORCHELASTIC_RUN_ID: listening on \
                     loopback {:?} under the public default key (any local user can join; set \
                     LOWBIT_RDZV_TOKEN to prevent that)",
                    server.local_addrs()
                );
            }
            if loopback && self.local_world_size.is_some_and(|l| l < self.world_size) {
                eprintln!(
                    "lowbit rendezvous: WARNING: rank 0 listens on loopback {:?} only, but \
                     LOCAL_WORLD_SIZE={} < WORLD_SIZE={}: ranks on other hosts cannot reach it \
                     (MASTER_ADDR={} resolves to loopback here; set LOWBIT_RDZV_BIND)",
                    server.local_addrs(),
                    self.local_world_size.unwrap_or(0),
                    self.world_size,
                    self.master_addr
                );
            }
            let bytes = payload()?;
            let options = ServeOptions::default();
            let links =
                server.serve_links(self.world_size, &bytes, &secret, timeout, options, keep)?;
            Ok((bytes, links))
        } else {
            let addr = self.server_addr();
            let loopback = addr
                .to_socket_addrs()
                .map(|a| {
                    let a: Vec<_> = a.collect();
                    !a.is_empty() && a.iter().all(|x| x.ip().is_loopback())
                })
                .unwrap_or(false);
            let secret = self.effective_secret(loopback)?;
            let (bytes, link) = fetch_link(&addr, self.rank, self.world_size, &secret, timeout)?;
            Ok((bytes, if keep { vec![link] } else { Vec::new() }))
        }
    }
}
