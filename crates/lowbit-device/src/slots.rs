//! The generation-checked slot table both backends keep their allocations in.
//!
//! A [`BufferId`] names a slot, the generation the slot was in when the buffer was allocated, and
//! the device: a freed buffer's views stay invalid after its slot is reused, and a view of
//! another device is rejected, with [`DeviceError::Freed`] either way.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::{BufferId, DeviceError, Result, View};

/// Source of device ids, so that a view of one device is rejected by another.
static NEXT_DEVICE: AtomicU32 = AtomicU32::new(0);

/// A fresh device id, unique among the devices of every backend in this process.
pub(crate) fn next_device_id() -> u32 {
    NEXT_DEVICE.fetch_add(1, Ordering::Relaxed)
}

/// One slot: its generation and, while a buffer lives in it, the allocation.
#[derive(Debug, Default)]
pub(crate) struct Slot<T> {
    pub(crate) generation: u32,
    pub(crate) data: Option<T>,
}

/// The allocations of one device, by slot.
#[derive(Debug)]
pub(crate) struct Slots<T> {
    /// The device's id; every [`BufferId`] handed out carries it.
    id: u32,
    slots: Vec<Slot<T>>,
    /// Freed slots, reused last freed first.
    free: Vec<u32>,
}

impl<T> Slots<T> {
    /// An empty table with a fresh device id.
    pub(crate) fn new() -> Self {
        Slots {
            id: next_device_id(),
            slots: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Stores `data` in the last freed slot (one generation on) or a new slot, and returns its
    /// id; `None` (dropping `data`) when there would be more than 2^32 slots.
    pub(crate) fn insert(&mut self, data: T) -> Option<BufferId> {
        let data = Some(data);
        if let Some(index) = self.free.pop() {
            let slot = &mut self.slots[index as usize];
            slot.generation = slot.generation.wrapping_add(1);
            slot.data = data;
            Some(BufferId {
                device: self.id,
                index,
                generation: slot.generation,
            })
        } else {
            let index = u32::try_from(self.slots.len()).ok()?;
            self.slots.push(Slot {
                generation: 0,
                data,
            });
            Some(BufferId {
                device: self.id,
                index,
                generation: 0,
            })
        }
    }

    /// Drops the allocation of a live `id` and frees its slot.
    pub(crate) fn remove(&mut self, id: BufferId) -> Result<()> {
        self.get(id)?;
        self.slots[id.index as usize].data = None;
        self.free.push(id.index);
        Ok(())
    }

    /// The index of `id`'s slot, if `id` is a live buffer of this device.
    fn live(&self, id: BufferId) -> Result<usize> {
        let index = id.index as usize;
        let live = id.device == self.id
            && self
                .slots
                .get(index)
                .is_some_and(|s| s.generation == id.generation && s.data.is_some());
        if live {
            Ok(index)
        } else {
            Err(DeviceError::Freed(id.index))
        }
    }

    /// The allocation of a live `id`.
    pub(crate) fn get(&self, id: BufferId) -> Result<&T> {
        let index = self.live(id)?;
        self.slots[index]
            .data
            .as_ref()
            .ok_or(DeviceError::Freed(id.index))
    }

    /// The allocation of a live `id`, mutably.
    pub(crate) fn get_mut(&mut self, id: BufferId) -> Result<&mut T> {
        let index = self.live(id)?;
        self.slots[index]
            .data
            .as_mut()
            .ok_or(DeviceError::Freed(id.index))
    }

    /// The live allocations.
    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|s| s.data.as_ref())
    }

    /// Every slot, for borrowing several allocations at once.
    pub(crate) fn slots_mut(&mut self) -> &mut [Slot<T>] {
        &mut self.slots
    }

    /// Drops every allocation.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn clear(&mut self) {
        self.slots.clear();
    }
}

/// Checks that `v` lies within a buffer of `len` bytes.
pub(crate) fn check_bounds(v: View, len: usize) -> Result<()> {
    let r = v.byte_range();
    if r.end > len {
        return Err(DeviceError::OutOfBounds {
            what: "view",
            start: r.start,
            end: r.end,
            len,
        });
    }
    Ok(())
}
