//! The job secret both sides prove they hold, and the keys and messages derived from it.

use super::mac::{hmac, random32};

/// The key every rank of one job holds; the rendezvous proves it in both directions.
///
/// Made from `LOWBIT_RDZV_TOKEN` ([`RendezvousSecret::from_token`]), from torchrun's run id
/// ([`RendezvousSecret::from_run_id`]), or the public default ([`RendezvousSecret::public`]),
/// which authenticates nothing and is accepted on loopback addresses only. `Debug` never shows
/// the key.
#[derive(Clone, PartialEq, Eq)]
pub struct RendezvousSecret {
    key: [u8; 32],
    source: &'static str,
}

impl std::fmt::Debug for RendezvousSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RendezvousSecret({}, key hidden)", self.source)
    }
}

impl RendezvousSecret {
    /// From a shared token (`LOWBIT_RDZV_TOKEN`): any bytes, the same on every rank.
    pub fn from_token(token: &[u8]) -> Self {
        RendezvousSecret {
            key: hmac(token, &[b"lowbit rendezvous v2 token"]),
            source: "LOWBIT_RDZV_TOKEN",
        }
    }

    /// From the launcher's run id (`TORCHELASTIC_RUN_ID`): only as secret as the id is
    /// (`torchrun --standalone` draws a random UUID; `--rdzv-id` is whatever was passed).
    pub fn from_run_id(run_id: &str) -> Self {
        RendezvousSecret {
            key: hmac(run_id.as_bytes(), &[b"lowbit rendezvous v2 run id"]),
            source: "TORCHELASTIC_RUN_ID",
        }
    }

    /// The public default key: proves nothing, so it is accepted only where every address
    /// involved is a loopback address (one host).
    pub fn public() -> Self {
        RendezvousSecret {
            key: hmac(b"", &[b"lowbit rendezvous v2 public default"]),
            source: "public default",
        }
    }

    /// Whether this is the public default key.
    pub fn is_public(&self) -> bool {
        *self == Self::public()
    }

    /// Where the key came from (for messages).
    pub fn source(&self) -> &'static str {
        self.source
    }

    pub(super) fn server_proof(&self, transcript: &[u8]) -> [u8; 32] {
        hmac(&self.key, &[b"lowbit-rdzv-v2 server proof", transcript])
    }

    pub(super) fn client_proof(&self, transcript: &[u8]) -> [u8; 32] {
        hmac(&self.key, &[b"lowbit-rdzv-v2 client proof", transcript])
    }

    pub(super) fn session(&self, transcript: &[u8]) -> Session {
        Session(hmac(
            &self.key,
            &[b"lowbit-rdzv-v2 session key", transcript],
        ))
    }
}

/// The key of one connection: encrypts and authenticates the payload.
pub(super) struct Session([u8; 32]);

impl Session {
    /// XORs `data` with the HMAC-SHA256 counter-mode keystream (its own inverse).
    pub(super) fn apply_keystream(&self, data: &mut [u8]) {
        for (i, chunk) in data.chunks_mut(32).enumerate() {
            let block = hmac(
                &self.0,
                &[b"lowbit-rdzv-v2 stream", &(i as u64).to_le_bytes()],
            );
            for (d, k) in chunk.iter_mut().zip(block) {
                *d ^= k;
            }
        }
    }

    /// The key that authenticates the liveness frames on this connection after the
    /// rendezvous (derived, so it never equals a key used above).
    pub(super) fn liveness_key(&self) -> [u8; 32] {
        hmac(&self.0, &[b"lowbit-live-v1 frame key"])
    }

    pub(super) fn tag(&self, header: &[u8], ciphertext: &[u8]) -> [u8; 32] {
        hmac(
            &self.0,
            &[b"lowbit-rdzv-v2 payload tag", header, ciphertext],
        )
    }
}

/// A fresh 32-byte nonce.
pub(super) fn nonce() -> [u8; 32] {
    random32()
}
