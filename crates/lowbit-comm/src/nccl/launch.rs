//! Launches: validating a launch and resolving its views into NCCL calls, enqueueing them as one
//! group on the communicator's stream after the device stream's work, host waits within the
//! timeout, and the handle of a launch in flight.

use std::ffi::c_int;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::sys;
use lowbit_device::{DType, Device};

use super::watchdog::{Pending, Shared, backoff};
use super::{NcclComm, cuda_stream};
use crate::{CommError, Op, ReduceOp, Result};

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

fn nccl_op(r: ReduceOp) -> sys::ncclRedOp_t {
    match r {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

impl NcclComm {
    /// Validates a launch on this rank (the in-process group's argument checks, the device is
    /// this communicator's GPU, every view live and in bounds on it) and resolves it into NCCL
    /// calls (none for ops of zero elements), with the device's stream.
    pub(super) fn calls(
        &self,
        dev: &Device,
        ops: &[Op],
        launch: &str,
        op_labels: &[String],
    ) -> Result<(Arc<CudaStream>, Vec<Call>)> {
        crate::op::check_launch(ops, self.rank, self.size, launch, op_labels)?;
        let dev_stream = self.device_stream(dev, launch)?;
        let mut calls = Vec::with_capacity(ops.len());
        for (op, label) in ops.iter().zip(op_labels) {
            let ptr = |v| {
                dev.cuda_device_ptr(v)
                    .map_err(|e| self.device_error(label, e))
            };
            let call = match *op {
                Op::AllGather { input, output } if !input.is_empty() => Call::AllGather {
                    send: ptr(input)?,
                    recv: ptr(output)?,
                    count: input.len(),
                    dtype: nccl_dtype(input.dtype()),
                },
                Op::ReduceScatter {
                    input,
                    output,
                    reduce,
                } if !output.is_empty() => Call::ReduceScatter {
                    send: ptr(input)?,
                    recv: ptr(output)?,
                    count: output.len(),
                    dtype: nccl_dtype(input.dtype()),
                    op: nccl_op(reduce),
                },
                Op::AllReduce { buf, reduce } if !buf.is_empty() => Call::AllReduce {
                    buf: ptr(buf)?,
                    count: buf.len(),
                    dtype: nccl_dtype(buf.dtype()),
                    op: nccl_op(reduce),
                },
                Op::Broadcast { buf, root } if !buf.is_empty() => Call::Broadcast {
                    buf: ptr(buf)?,
                    count: buf.len(),
                    dtype: nccl_dtype(buf.dtype()),
                    // check_launch bounded the root by the group size, which fits a c_int.
                    root: root as c_int,
                },
                // Zero elements on every rank (the ranks agree on counts): nothing to move.
                _ => continue,
            };
            calls.push(call);
        }
        Ok((dev_stream, calls))
    }

    /// Waits on the host for `event`, within the timeout.
    pub(super) fn host_wait(&self, event: &CudaEvent, op: &str) -> Result<()> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.driver_error(op, "cuEventQuery", e)),
            }
            {
                let mut st = self.shared.lock();
                self.shared.check(&mut st, op)?;
                if start.elapsed() >= self.config.timeout {
                    return Err(self.shared.fail_timeout(&mut st, op, start));
                }
            }
            backoff(&mut polls);
        }
    }

    /// Enqueues `calls` as one NCCL group on the communicator's stream after the device stream's
    /// work so far, and returns the completion event.
    pub(super) fn launch(
        &mut self,
        dev_stream: &CudaStream,
        label: &str,
        calls: &[Call],
    ) -> Result<Arc<CudaEvent>> {
        let start = Instant::now();
        let mut st = self.shared.lock();
        self.shared.check(&mut st, label)?;
        let _ = self.shared.ctx.bind_to_thread();
        self.ready
            .record(dev_stream)
            .map_err(|e| self.driver_error(label, "recording the ready event", e))?;
        self.stream
            .wait(&self.ready)
            .map_err(|e| self.driver_error(label, "ordering after the device stream", e))?;
        let comm = st.comm.0;
        let s = self.stream.cu_stream() as sys::cudaStream_t;
        // Watched by the departure backstop while it may block (see `World::enqueuing`).
        let enqueue = self.shared.whole_world.then(|| self.shared.world.enqueue());
        // SAFETY: plain group bracket; it is thread-local state in NCCL.
        let r = unsafe { sys::ncclGroupStart() };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(self.shared.nccl_error(label, "ncclGroupStart", r, &st));
        }
        let mut first_error = None;
        for c in calls {
            // SAFETY: every pointer was resolved by `Device::cuda_device_ptr` from a live view
            // of this GPU and the element counts match the views (checked by
            // `op::check_launch`); the handle is live and we hold its mutex; the stream belongs
            // to the communicator's GPU.
            let r = unsafe {
                match *c {
                    Call::AllGather {
                        send,
                        recv,
                        count,
                        dtype,
                    } => {
                        sys::ncclAllGather(send as *const _, recv as *mut _, count, dtype, comm, s)
                    }
                    Call::ReduceScatter {
                        send,
                        recv,
                        count,
                        dtype,
                        op,
                    } => sys::ncclReduceScatter(
                        send as *const _,
                        recv as *mut _,
                        count,
                        dtype,
                        op,
                        comm,
                        s,
                    ),
                    Call::AllReduce {
                        buf,
                        count,
                        dtype,
                        op,
                    } => sys::ncclAllReduce(
                        buf as *const _,
                        buf as *mut _,
                        count,
                        dtype,
                        op,
                        comm,
                        s,
                    ),
                    Call::Broadcast {
                        buf,
                        count,
                        dtype,
                        root,
                    } => sys::ncclBroadcast(
                        buf as *const _,
                        buf as *mut _,
                        count,
                        dtype,
                        root,
                        comm,
                        s,
                    ),
                }
            };
            if !matches!(
                r,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) && first_error.is_none()
            {
                first_error = Some(self.shared.nccl_error(label, "enqueueing", r, &st));
            }
        }
        // SAFETY: closes the group opened above (always, so NCCL's group depth stays balanced).
        let r = unsafe { sys::ncclGroupEnd() };
        if let Some(e) = first_error {
            return Err(e);
        }
        if !matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) {
            return Err(self.shared.nccl_error(label, "ncclGroupEnd", r, &st));
        }
        if r == sys::ncclResult_t::ncclInProgress {
            let (settled_st, settled) = self.shared.settle(st, label, start);
            st = settled_st;
            settled?;
        }
        drop(enqueue);
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.driver_error(label, "recording the completion event", e))?;
        let event = Arc::new(event);
        st.pending.push_back(Pending {
            event: Arc::clone(&event),
            started: start,
            label: label.to_string(),
        });
        // No wake-up: the watchdog polls pending launches every millisecond (every 20 ms when
        // idle), and a wake-up per launch costs more than the launch.
        Ok(event)
    }
}

/// One NCCL call of a launch, with resolved device addresses.
#[derive(Clone, Copy, Debug)]
pub(super) enum Call {
    AllGather {
        send: u64,
        recv: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
    },
    ReduceScatter {
        send: u64,
        recv: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
        op: sys::ncclRedOp_t,
    },
    AllReduce {
        buf: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
        op: sys::ncclRedOp_t,
    },
    Broadcast {
        buf: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
        root: c_int,
    },
}

/// An NCCL launch in flight.
pub(crate) struct NcclWork {
    pub(super) shared: Arc<Shared>,
    pub(super) event: Arc<CudaEvent>,
    pub(super) launch: String,
    pub(super) ordinal: usize,
}

impl fmt::Debug for NcclWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclWork")
            .field("launch", &self.launch)
            .field("rank", &self.shared.rank)
            .finish_non_exhaustive()
    }
}

impl NcclWork {
    /// Makes `dev`'s stream wait for the launch (the host does not block). Fails if the
    /// communicator already failed.
    pub(crate) fn wait(self, dev: &mut Device) -> Result<()> {
        {
            let mut st = self.shared.lock();
            self.shared.check(&mut st, &self.launch)?;
        }
        let stream = cuda_stream(dev, self.shared.rank, &self.launch)?;
        if dev.cuda_ordinal() != Some(self.ordinal) {
            return Err(CommError::Device {
                op: self.launch.clone(),
                rank: self.shared.rank,
                source: Box::new(lowbit_device::DeviceError::Unsupported(format!(
                    "waited on GPU {:?}, the launch ran on GPU {}",
                    dev.cuda_ordinal(),
                    self.ordinal
                ))),
            });
        }
        stream.wait(&self.event).map_err(|e| CommError::Nccl {
            op: self.launch.clone(),
            rank: self.shared.rank,
            detail: format!("ordering the device stream after the launch: {e:?}"),
        })
    }
}
