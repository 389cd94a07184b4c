//! A `Communicator` implemented outside the crate, as a downstream transport would: ranks are
//! threads that exchange their contributions over channels, and `start_coalesced` returns a
//! `Work::pending` handle that receives and reduces only in `Work::wait`. Also the closure form
//! (`Work::from_fn`), error propagation from a pending wait, and drops without waiting.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use lowbit_comm::{
    CommError, CommStats, Communicator, DType, Device, Op, PendingWork, ReduceOp, Result, View,
    Work,
};

/// One rank's contribution to launch `seq`: the f32 inputs of its ops, in op order.
struct Msg {
    seq: u64,
    inputs: Vec<Vec<f32>>,
}

/// What one rank has received: a receiver per peer (`None` for itself) and the messages that
/// arrived for launches not waited on yet.
struct Inbox {
    from: Vec<Option<Receiver<Msg>>>,
    stash: HashMap<(usize, u64), Vec<Vec<f32>>>,
}

/// A rank of the channel world. Supports f32 all-reduce (sum, max) only.
struct ChannelComm {
    rank: usize,
    size: usize,
    seq: u64,
    to: Vec<Option<Sender<Msg>>>,
    inbox: Arc<Mutex<Inbox>>,
    barrier: Arc<Barrier>,
    stats: CommStats,
}

impl std::fmt::Debug for ChannelComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ChannelComm {{ rank: {}, size: {} }}",
            self.rank, self.size
        )
    }
}

fn world(size: usize) -> Vec<ChannelComm> {
    let mut to: Vec<Vec<Option<Sender<Msg>>>> = (0..size).map(|_| Vec::new()).collect();
    let mut from: Vec<Vec<Option<Receiver<Msg>>>> = (0..size).map(|_| Vec::new()).collect();
    for (p, to_p) in to.iter_mut().enumerate() {
        for (q, from_q) in from.iter_mut().enumerate() {
            if p == q {
                to_p.push(None);
                from_q.push(None);
            } else {
                let (tx, rx) = channel();
                to_p.push(Some(tx));
                from_q.push(Some(rx));
            }
        }
    }
    let barrier = Arc::new(Barrier::new(size));
    to.into_iter()
        .zip(from)
        .enumerate()
        .map(|(rank, (to, from))| ChannelComm {
            rank,
            size,
            seq: 0,
            to,
            inbox: Arc::new(Mutex::new(Inbox {
                from,
                stash: HashMap::new(),
            })),
            barrier: Arc::clone(&barrier),
            stats: CommStats::default(),
        })
        .collect()
}

/// Runs `f` on `size` threads, rank `r` with its own communicator (as `&mut dyn Communicator`)
/// and CPU device.
fn run<T: Send>(size: usize, f: impl Fn(&mut dyn Communicator, &mut Device) -> T + Sync) -> Vec<T> {
    let comms = world(size);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let f = &f;
                s.spawn(move || f(&mut comm, &mut Device::cpu()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn label(seq: u64) -> String {
    format!("channel launch #{seq}")
}

impl Communicator for ChannelComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn start_coalesced(&mut self, dev: &mut Device, ops: &[Op]) -> Result<Work> {
        let seq = self.seq;
        self.seq += 1;
        let mut bufs = Vec::new();
        let mut inputs = Vec::new();
        for op in ops {
            let Op::AllReduce { buf, reduce } = *op else {
                unimplemented!("the channel test double only all-reduces");
            };
            assert!(matches!(reduce, ReduceOp::Sum | ReduceOp::Max));
            if buf.dtype() != DType::F32 {
                return Err(CommError::DType {
                    op: label(seq),
                    rank: self.rank,
                    what: "buf".into(),
                    expected: "f32".into(),
                    got: buf.dtype(),
                });
            }
            let x = dev.download::<f32>(buf).map_err(|e| CommError::Device {
                op: label(seq),
                rank: self.rank,
                source: Box::new(e),
            })?;
            bufs.push((buf, reduce));
            inputs.push(x);
        }
        // Send now (never blocks: channels are unbounded); a peer that is gone is noticed by
        // the peers' waits.
        for tx in self.to.iter().flatten() {
            let _ = tx.send(Msg {
                seq,
                inputs: inputs.clone(),
            });
        }
        self.stats.launches += 1;
        self.stats.all_reduce.calls += ops.len() as u64;
        Ok(Work::pending(ChannelWork {
            rank: self.rank,
            seq,
            own: inputs,
            bufs,
            inbox: Arc::clone(&self.inbox),
        }))
    }

    fn barrier(&mut self) -> Result<()> {
        self.barrier.wait();
        self.stats.barriers += 1;
        Ok(())
    }

    fn split(&mut self, _color: u32, _key: u32) -> Result<Box<dyn Communicator>> {
        unimplemented!("not needed by these tests")
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn abort(&mut self, _reason: &str) {
        self.to.iter_mut().for_each(|tx| *tx = None);
    }
}

/// A launch of the channel world in flight: nothing is received or written before `wait`.
#[derive(Debug)]
struct ChannelWork {
    rank: usize,
    seq: u64,
    own: Vec<Vec<f32>>,
    bufs: Vec<(View, ReduceOp)>,
    inbox: Arc<Mutex<Inbox>>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Inbox {{ stashed: {} }}", self.stash.len())
    }
}

impl PendingWork for ChannelWork {
    fn wait(self: Box<Self>, dev: &mut Device) -> Result<()> {
        let op = label(self.seq);
        let size = self.inbox.lock().unwrap().from.len();
        // Every rank's inputs, in rank order.
        let mut all: Vec<Vec<Vec<f32>>> = Vec::with_capacity(size);
        for q in 0..size {
            if q == self.rank {
                all.push(self.own.clone());
                continue;
            }
            let mut inbox = self.inbox.lock().unwrap();
            loop {
                if let Some(x) = inbox.stash.remove(&(q, self.seq)) {
                    all.push(x);
                    break;
                }
                let rx = inbox.from[q].as_ref().expect("peer receiver");
                match rx.recv_timeout(Duration::from_secs(10)) {
                    Ok(m) => {
                        inbox.stash.insert((q, m.seq), m.inputs);
                    }
                    Err(_) => {
                        return Err(CommError::Aborted {
                            op,
                            rank: self.rank,
                            by_rank: q,
                            reason: "the peer's channel closed".into(),
                        });
                    }
                }
            }
        }
        for (i, &(buf, reduce)) in self.bufs.iter().enumerate() {
            let lens: Vec<usize> = all.iter().map(|x| x[i].len()).collect();
            if lens.iter().any(|&n| n != lens[0]) {
                return Err(CommError::Mismatch {
                    op,
                    what: "element count",
                    values: lens.iter().map(usize::to_string).collect(),
                });
            }
            let mut out = all[0][i].clone();
            for x in &all[1..] {
                for (o, v) in out.iter_mut().zip(&x[i]) {
                    *o = match reduce {
                        ReduceOp::Max => o.max(*v),
                        _ => *o + *v,
                    };
                }
            }
            dev.upload(buf, &out).map_err(|e| CommError::Device {
                op: op.clone(),
                rank: self.rank,
                source: Box::new(e),
            })?;
        }
        Ok(())
    }
}

/// The output is written by `wait`, not by `start`, even when every peer's contribution has
/// already arrived; used only through `&mut dyn Communicator`.
#[test]
fn pending_work_completes_only_at_wait() {
    for size in [1, 2, 3, 4] {
        let got = run(size, |comm, dev| {
            let r = comm.rank() as f32;
            let a = dev.alloc(DType::F32, 3);
            dev.upload(a, &[r + 1.0, 10.0 * r, -r]).unwrap();
            let b = dev.alloc(DType::F32, 2);
            dev.upload(b, &[r, 7.0 - r]).unwrap();
            let wa = comm.start_all_reduce(dev, a, ReduceOp::Sum).unwrap();
            let wb = comm.start_all_reduce(dev, b, ReduceOp::Max).unwrap();
            assert!(format!("{wa:?}").contains("ChannelWork"), "{wa:?}");
            // Every rank has sent both launches once all pass the barrier.
            comm.barrier().unwrap();
            let before = (
                dev.download::<f32>(a).unwrap(),
                dev.download::<f32>(b).unwrap(),
            );
            // Waited in the other order than started.
            wb.wait(dev).unwrap();
            let mid = dev.download::<f32>(a).unwrap();
            wa.wait(dev).unwrap();
            // The blocking default methods go through the same pending handles.
            let c = dev.alloc(DType::F32, 1);
            dev.upload(c, &[r]).unwrap();
            comm.all_reduce(dev, c, ReduceOp::Sum).unwrap();
            let after = (
                dev.download::<f32>(a).unwrap(),
                dev.download::<f32>(b).unwrap(),
                dev.download::<f32>(c).unwrap(),
            );
            (r, before, mid, after, comm.stats())
        });
        let n = size as f32;
        let sum_r = n * (n - 1.0) / 2.0;
        for (r, before, mid, after, stats) in got {
            assert_eq!(
                before.0,
                vec![r + 1.0, 10.0 * r, -r],
                "size {size}: a before wait"
            );
            assert_eq!(before.1, vec![r, 7.0 - r], "size {size}: b before wait");
            assert_eq!(mid, before.0, "size {size}: a written by b's wait");
            assert_eq!(
                after.0,
                vec![sum_r + n, 10.0 * sum_r, -sum_r],
                "size {size}: a"
            );
            assert_eq!(after.1, vec![n - 1.0, 7.0], "size {size}: b");
            assert_eq!(after.2, vec![sum_r], "size {size}: c");
            assert_eq!(stats.launches, 3);
            assert_eq!(stats.all_reduce.calls, 3);
        }
    }
}

/// Errors of a pending wait reach the caller: ranks that disagree on the element count, and a
/// peer that left.
#[test]
fn pending_wait_errors_propagate() {
    let got = run(3, |comm, dev| {
        let n = if comm.rank() == 1 { 3 } else { 2 };
        let v = dev.alloc(DType::F32, n);
        let w = comm.start_all_reduce(dev, v, ReduceOp::Sum).unwrap();
        w.wait(dev)
    });
    for e in got {
        match e {
            Err(CommError::Mismatch { what, values, .. }) => {
                assert_eq!(what, "element count");
                assert_eq!(values, ["2", "3", "2"]);
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }

    let got = run(2, |comm, dev| {
        let v = dev.alloc(DType::F32, 1);
        if comm.rank() == 1 {
            // Leaves without contributing: its senders are dropped when it returns.
            comm.abort("leaving");
            return Ok(());
        }
        comm.start_all_reduce(dev, v, ReduceOp::Sum)?.wait(dev)
    });
    match &got[0] {
        Err(CommError::Aborted { by_rank: 1, op, .. }) => assert_eq!(op, "channel launch #0"),
        other => panic!("expected an abort by rank 1, got {other:?}"),
    }
    assert!(got[1].is_ok());

    // An error of `start` (invalid arguments) is returned by `start`, not deferred.
    let mut comm = world(1).pop().unwrap();
    let mut dev = Device::cpu();
    let v = dev.alloc(DType::Bf16, 2);
    let e = (&mut comm as &mut dyn Communicator)
        .start_all_reduce(&mut dev, v, ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(e, CommError::DType { .. }), "{e:?}");
}

/// `Work::from_fn` runs its closure once, in `wait`, on the waiting device, and returns its
/// result; dropped, it never runs.
#[test]
fn closure_work_runs_at_wait_and_propagates_errors() {
    let mut dev = Device::cpu();
    let out = dev.alloc(DType::F32, 2);
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&runs);
    let work = Work::from_fn(move |dev: &mut Device| {
        counter.fetch_add(1, Ordering::SeqCst);
        dev.upload(out, &[4.0f32, 5.0])
            .map_err(|e| CommError::Device {
                op: "from_fn".into(),
                rank: 0,
                source: Box::new(e),
            })
    });
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(dev.download::<f32>(out).unwrap(), vec![0.0, 0.0]);
    work.wait(&mut dev).unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(dev.download::<f32>(out).unwrap(), vec![4.0, 5.0]);

    let err = CommError::Timeout {
        op: "outside #7".into(),
        rank: 2,
        waited: Duration::from_millis(5),
        missing: vec![0, 3],
    };
    let expected = err.clone_for_test();
    let work = Work::from_fn(move |_| Err(err));
    assert_eq!(work.wait(&mut dev), Err(expected));

    // A write to a freed view fails in the closure, and that error is the wait's.
    let gone = dev.alloc(DType::F32, 1);
    dev.free(gone).unwrap();
    let work = Work::from_fn(move |dev: &mut Device| {
        dev.upload(gone, &[1.0f32]).map_err(|e| CommError::Device {
            op: "from_fn".into(),
            rank: 0,
            source: Box::new(e),
        })
    });
    assert!(matches!(work.wait(&mut dev), Err(CommError::Device { .. })));

    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    drop(Work::from_fn(move |_| {
        flag.store(true, Ordering::SeqCst);
        Ok(())
    }));
    assert!(
        !ran.load(Ordering::SeqCst),
        "a dropped handle must not complete"
    );
}

/// A pending work dropped without waiting is dropped (its `Drop` releases its resources), and
/// never waited.
#[test]
fn dropped_pending_work_is_dropped_not_waited() {
    #[derive(Debug)]
    struct Tracked(Arc<AtomicUsize>);
    impl PendingWork for Tracked {
        fn wait(self: Box<Self>, _dev: &mut Device) -> Result<()> {
            self.0.fetch_add(100, Ordering::SeqCst);
            Ok(())
        }
    }
    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let n = Arc::new(AtomicUsize::new(0));
    let w = Work::pending(Tracked(Arc::clone(&n)));
    assert!(format!("{w:?}").contains("Tracked"), "{w:?}");
    drop(w);
    assert_eq!(n.load(Ordering::SeqCst), 1);
    Work::pending_boxed(Box::new(Tracked(Arc::clone(&n))))
        .wait(&mut Device::cpu())
        .unwrap();
    assert_eq!(n.load(Ordering::SeqCst), 102);
}

/// `Work` stays `Send + Sync` (as before pending handles existed) though a pending operation
/// need only be `Send`, as a channel receiver is.
#[test]
fn work_is_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Work>();
    #[derive(Debug)]
    struct NotSync(Receiver<()>);
    impl PendingWork for NotSync {
        fn wait(self: Box<Self>, _dev: &mut Device) -> Result<()> {
            self.0.try_recv().ok();
            Ok(())
        }
    }
    let (_tx, rx) = channel();
    let w = Work::pending(NotSync(rx));
    std::thread::spawn(move || w.wait(&mut Device::cpu()).unwrap())
        .join()
        .unwrap();
}

/// Test-only stand-in for `Clone` (CommError is not `Clone`: its device source is boxed).
trait CloneForTest {
    fn clone_for_test(&self) -> Self;
}

impl CloneForTest for CommError {
    fn clone_for_test(&self) -> Self {
        match self {
            CommError::Timeout {
                op,
                rank,
                waited,
                missing,
            } => CommError::Timeout {
                op: op.clone(),
                rank: *rank,
                waited: *waited,
                missing: missing.clone(),
            },
            _ => unimplemented!(),
        }
    }
}
