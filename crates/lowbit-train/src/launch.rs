//! Where the ranks come from: threads of this process on the CPU backend, one thread per
//! local GPU with NCCL, or one rank per process started by a launcher (torchrun, or anything
//! that sets its variables), NCCL's id through the TCP rendezvous.
//!
//! The launcher's variables are parsed strictly ([`LaunchEnv::from_lookup`]): `WORLD_SIZE`,
//! `RANK` and `LOCAL_RANK` are plain decimal numbers (no sign, no prefix, no spaces), the world
//! is not empty and both ranks lie in it. Anything else is a [`LaunchError`] naming the
//! variable, never a silent fallback to a local run.

use std::time::Duration;

use lowbit_comm::{Communicator, GroupConfig};
use lowbit_device::{DType, Device};

/// A launcher's variables refused, or a collective of the launcher's helpers that failed.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A variable that is not a plain decimal number.
    #[error("{var}={value:?} is not a non-negative decimal integer")]
    Malformed {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A variable out of its range (an empty world, a rank outside the world).
    #[error("{var}={value} {why}")]
    OutOfRange {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: usize,
        /// The rule it breaks.
        why: String,
    },
    /// A collective between the ranks failed.
    #[error(transparent)]
    Comm(#[from] lowbit_comm::CommError),
    /// A device operation failed.
    #[error(transparent)]
    Device(#[from] lowbit_device::DeviceError),
}

/// One process's place in a world a launcher started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `WORLD_SIZE`: processes in the world (one rank each).
    pub world_size: usize,
    /// `RANK`: this process's rank (0 when unset: a world of one needs no `RANK`).
    pub rank: usize,
    /// `LOCAL_RANK`: this process's GPU on its host (`RANK` when unset).
    pub local_rank: usize,
}

impl LaunchEnv {
    /// The process environment's launcher variables: `None` when `WORLD_SIZE` is unset (no
    /// launcher: the ranks are local).
    ///
    /// # Errors
    /// As [`LaunchEnv::from_lookup`].
    pub fn from_env() -> Result<Option<LaunchEnv>, LaunchError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// The launcher variables read through `get`.
    ///
    /// # Errors
    /// [`LaunchError::Malformed`] for a value that is not plain decimal digits (`abc`, `-1`,
    /// `0x2`, ` 2`, empty), [`LaunchError::OutOfRange`] for `WORLD_SIZE=0` or a `RANK` /
    /// `LOCAL_RANK` not below `WORLD_SIZE`.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<LaunchEnv>, LaunchError> {
        let number = |var: &'static str| -> Result<Option<usize>, LaunchError> {
            let Some(value) = get(var) else {
                return Ok(None);
            };
            let malformed = || LaunchError::Malformed {
                var,
                value: value.clone(),
            };
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return Err(malformed());
            }
            value.parse().map(Some).map_err(|_| malformed())
        };
        let Some(world_size) = number("WORLD_SIZE")? else {
            return Ok(None);
        };
        if world_size == 0 {
            return Err(LaunchError::OutOfRange {
                var: "WORLD_SIZE",
                value: 0,
                why: "is an empty world".into(),
            });
        }
        let rank = number("RANK")?.unwrap_or(0);
        let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
        for (var, value) in [("RANK", rank), ("LOCAL_RANK", local_rank)] {
            if value >= world_size {
                return Err(LaunchError::OutOfRange {
                    var,
                    value,
                    why: format!("is not below WORLD_SIZE={world_size}"),
                });
            }
        }
        Ok(Some(LaunchEnv {
            world_size,
            rank,
            local_rank,
        }))
    }
}

/// The ranks of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum World {
    /// `ranks` threads of this process on the CPU backend (local communicators).
    CpuThreads(usize),
    /// One thread per local GPU, NCCL among them.
    CudaLocal(usize),
    /// This process is one rank of a launcher's world, on GPU `LOCAL_RANK`.
    CudaProcess(LaunchEnv),
}

impl World {
    /// Whether this process runs one rank of several processes (its outcome is its own rank's
    /// only).
    pub fn is_process(&self) -> bool {
        matches!(self, World::CudaProcess(_))
    }
}

/// A rank that failed outside the caller's code: it panicked, or its device or communicator
/// could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}: {message}")]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// What happened.
    pub message: String,
}

/// Runs `f` on every rank of `world` this process holds, in rank order. CPU threads time out a
/// collective after `timeout`.
pub fn run<T, E>(
    world: World,
    timeout: Duration,
    f: impl Fn(&mut dyn Communicator, &mut Device) -> Result<T, E> + Sync,
) -> Vec<Result<T, E>>
where
    T: Send,
    E: From<RankFailure> + Send,
{
    match world {
        World::CpuThreads(ranks) => {
            let config = GroupConfig::default().with_timeout(timeout);
            lowbit_comm::run_ranks(ranks, config, |mut comm, mut dev| f(&mut comm, &mut dev))
                .into_iter()
                .map(|r| {
                    r.map_err(|e| {
                        E::from(RankFailure {
                            rank: e.rank,
                            message: format!("panicked: {}", e.message),
                        })
                    })
                    .and_then(|x| x)
                })
                .collect()
        }
        World::CudaLocal(ranks) => cuda::run_local(ranks, f),
        World::CudaProcess(env) => vec![cuda::run_process(env, f)],
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;

    fn unbuilt<E: From<RankFailure>>() -> E {
        E::from(RankFailure {
            rank: 0,
            message: "CUDA ranks need a build with the CUDA backend (feature `cuda`)".into(),
        })
    }

    pub(super) fn run_local<T, E: From<RankFailure>>(
        _: usize,
        _: impl Fn(&mut dyn Communicator, &mut Device) -> Result<T, E> + Sync,
    ) -> Vec<Result<T, E>> {
        vec![Err(unbuilt())]
    }

    pub(super) fn run_process<T, E: From<RankFailure>>(
        _: LaunchEnv,
        _: impl Fn(&mut dyn Communicator, &mut Device) -> Result<T, E>,
    ) -> Result<T, E> {
        Err(unbuilt())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use lowbit_comm::nccl::{NcclComm, NcclConfig};
    use lowbit_comm::rendezvous::RendezvousEnv;

    pub(super) fn run_local<T: Send, E: From<RankFailure> + Send>(
        ranks: usize,
        f: impl Fn(&mut dyn Communicator, &mut Device) -> Result<T, E> + Sync,
    ) -> Vec<Result<T, E>> {
        match lowbit_comm::nccl::run_local_ranks(ranks, f) {
            Ok(v) => v,
            Err(e) => vec![Err(E::from(RankFailure {
                rank: 0,
                message: e.to_string(),
            }))],
        }
    }

    /// This process's rank of a launcher's world: GPU `LOCAL_RANK`, the NCCL id through the
    /// TCP rendezvous (`MASTER_ADDR`, `MASTER_PORT`, the job secret: see `RendezvousEnv`).
    pub(super) fn run_process<T, E: From<RankFailure>>(
        env: LaunchEnv,
        f: impl Fn(&mut dyn Communicator, &mut Device) -> Result<T, E>,
    ) -> Result<T, E> {
        let fail = |message: String| {
            E::from(RankFailure {
                rank: env.rank,
                message,
            })
        };
        let rdzv = RendezvousEnv::from_env().map_err(|x| fail(x.to_string()))?;
        let mut dev = Device::cuda(env.local_rank).map_err(|x| fail(x.to_string()))?;
        let mut comm = NcclComm::from_env(&dev, &rdzv, NcclConfig::default())
            .map_err(|x| fail(x.to_string()))?;
        f(&mut comm, &mut dev)
    }
}

/// Every rank's `bytes`, in rank order (collective): the lengths are all-gathered to agree on
/// the longest, then the byte strings, zero-padded to it (the caller's encoding must tolerate
/// trailing zeros, or carry its own length).
///
/// # Errors
/// Collective and device errors.
pub fn all_gather_bytes(
    comm: &mut dyn Communicator,
    dev: &mut Device,
    bytes: &[u8],
) -> Result<Vec<Vec<u8>>, LaunchError> {
    let ranks = comm.size();
    let (len, lens) = (dev.alloc(DType::U8, 8), dev.alloc(DType::U8, 8 * ranks));
    dev.upload(len, &(bytes.len() as u64).to_le_bytes())?;
    comm.all_gather(dev, len, lens)?;
    let max = dev
        .download::<u8>(lens)?
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .max()
        .unwrap_or(0);
    dev.free(len)?;
    dev.free(lens)?;
    let mut padded = bytes.to_vec();
    padded.resize(max, 0);
    let input = dev.alloc(DType::U8, max);
    let output = dev.alloc(DType::U8, max * ranks);
    dev.upload(input, &padded)?;
    comm.all_gather(dev, input, output)?;
    let all = dev.download::<u8>(output)?;
    dev.free(input)?;
    dev.free(output)?;
    Ok(all
        .chunks(max.max(1))
        .map(<[u8]>::to_vec)
        .take(ranks)
        .collect())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::{LaunchEnv, LaunchError};

    fn parse(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>, LaunchError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_lookup(|k| map.get(k).cloned())
    }

    fn malformed_var(r: Result<Option<LaunchEnv>, LaunchError>) -> &'static str {
        match r {
            Err(LaunchError::Malformed { var, .. }) => var,
            other => panic!("not refused as malformed: {other:?}"),
        }
    }

    /// No `WORLD_SIZE`: no launcher; a whole set: that process; `LOCAL_RANK` defaults to `RANK`.
    #[test]
    fn well_formed_worlds() {
        assert_eq!(parse(&[]).unwrap(), None);
        assert_eq!(parse(&[("RANK", "3")]).unwrap(), None);
        let env = parse(&[("WORLD_SIZE", "4"), ("RANK", "3"), ("LOCAL_RANK", "1")]);
        assert_eq!(
            env.unwrap(),
            Some(LaunchEnv {
                world_size: 4,
                rank: 3,
                local_rank: 1
            })
        );
        let env = parse(&[("WORLD_SIZE", "2"), ("RANK", "1")])
            .unwrap()
            .unwrap();
        assert_eq!(env.local_rank, 1);
    }

    /// `abc`, `-1`, `0x2`, empty, spaces and `+1` are refused, naming the variable.
    #[test]
    fn malformed_values_name_the_variable() {
        for bad in ["abc", "-1", "0x2", "", " 2", "2 ", "+1", "1.0"] {
            assert_eq!(
                malformed_var(parse(&[("WORLD_SIZE", bad), ("RANK", "0")])),
                "WORLD_SIZE"
            );
            assert_eq!(
                malformed_var(parse(&[("WORLD_SIZE", "4"), ("RANK", bad)])),
                "RANK"
            );
            let r = parse(&[("WORLD_SIZE", "4"), ("RANK", "0"), ("LOCAL_RANK", bad)]);
            assert_eq!(malformed_var(r), "LOCAL_RANK");
        }
        let e = parse(&[("WORLD_SIZE", "abc"), ("RANK", "0")]).unwrap_err();
        assert!(e.to_string().contains("WORLD_SIZE=\"abc\""), "{e}");
    }

    /// An empty world, `RANK >= WORLD_SIZE` and `LOCAL_RANK >= WORLD_SIZE` are refused; a
    /// missing `RANK` is rank 0.
    #[test]
    fn out_of_range_and_missing() {
        let var = |r: Result<Option<LaunchEnv>, LaunchError>| match r {
            Err(LaunchError::OutOfRange { var, .. }) => var,
            other => panic!("not refused as out of range: {other:?}"),
        };
        assert_eq!(
            var(parse(&[("WORLD_SIZE", "0"), ("RANK", "0")])),
            "WORLD_SIZE"
        );
        assert_eq!(var(parse(&[("WORLD_SIZE", "2"), ("RANK", "2")])), "RANK");
        assert_eq!(var(parse(&[("WORLD_SIZE", "2"), ("RANK", "7")])), "RANK");
        let r = parse(&[("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "2")]);
        assert_eq!(var(r), "LOCAL_RANK");
        let env = parse(&[("WORLD_SIZE", "2")]).unwrap().unwrap();
        assert_eq!((env.rank, env.local_rank), (0, 0));
    }
}
