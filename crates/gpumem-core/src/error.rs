//! Every failure gpumem can report, as typed errors whose messages say what to do.

use crate::backend::DriverCall;
use crate::units::format_size;
use std::fmt;

/// An error from the device layer (the CUDA driver, or the simulated device).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {message}")]
pub struct BackendError {
    /// The driver call that failed.
    pub call: DriverCall,
    /// True when the device itself is out of memory (CUDA_ERROR_OUT_OF_MEMORY).
    pub out_of_memory: bool,
    /// What the driver said.
    pub message: String,
}

impl BackendError {
    /// A failure that is not an out-of-memory condition.
    pub fn new(call: DriverCall, message: impl Into<String>) -> Self {
        Self {
            call,
            out_of_memory: false,
            message: message.into(),
        }
    }

    /// The device has no memory left for this call.
    pub fn oom(call: DriverCall, message: impl Into<String>) -> Self {
        Self {
            call,
            out_of_memory: true,
            message: message.into(),
        }
    }
}

/// What the allocator knew when a request could not be met: enough to tell whether the
/// memory is really used, cached, or fragmented.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OomReport {
    /// Bytes asked for (before rounding).
    pub requested: u64,
    /// Stream the request was made on.
    pub stream: u64,
    /// Policy in use.
    pub policy: String,
    /// Total memory of the device.
    pub device_total: u64,
    /// Free memory of the device as the driver (or the simulation) reports it.
    pub device_free: u64,
    /// Limit set by preallocation or `set_memory_fraction`, if any.
    pub cap: Option<u64>,
    /// Bytes held from the device by this allocator after releasing its cache.
    pub held: u64,
    /// Bytes of live allocations.
    pub allocated: u64,
    /// Held but not allocated (cached, or lost to fragmentation).
    pub cached: u64,
    /// Largest free block the allocator holds for the requesting stream (blocks cached for
    /// other streams cannot serve it).
    pub largest_free_block: u64,
    /// Times the allocator released its cache and retried before giving up.
    pub retries: u64,
    /// A CUDA graph capture was underway, during which nothing can be given back to the
    /// device (so the cache was not released).
    pub during_capture: bool,
}

impl OomReport {
    /// `cached / held`: the share of held memory that is not in use.
    pub fn fragmentation(&self) -> f64 {
        if self.held == 0 {
            0.0
        } else {
            self.cached as f64 / self.held as f64
        }
    }

    /// Bytes the allocator could still take from the device: its free memory, within the cap.
    pub fn obtainable(&self) -> u64 {
        match self.cap {
            Some(cap) => self.device_free.min(cap.saturating_sub(self.held)),
            None => self.device_free,
        }
    }

    /// The change that the numbers point to.
    pub fn suggestion(&self) -> String {
        if self.during_capture && self.cached > 0 {
            return format!(
                "a CUDA graph capture was underway (or a private pool was being filled), during \
                 which gpumem cannot give its {} of cached memory back to the device: call \
                 torch.cuda.empty_cache() (or Allocator::empty_cache) before the capture, or \
                 capture with less memory.",
                format_size(self.cached)
            );
        }
        // Enough memory in pieces (cached blocks, plus what the device still has), but no
        // piece large enough: fragmentation, which stitching removes by mapping free pages
        // under the new block wherever they are.
        let pieces = self.cached.saturating_add(self.obtainable());
        if self.policy != "stitched"
            && pieces >= self.requested
            && self.largest_free_block < self.requested
        {
            return format!(
                "{} are cached{} but the largest free block is {}: the memory is fragmented. \
                 Try GPUMEM_CONF=policy:stitched, which maps free pages wherever they are \
                 needed.",
                format_size(self.cached),
                if self.obtainable() > 0 {
                    format!(
                        " and {} more is free on the device",
                        format_size(self.obtainable())
                    )
                } else {
                    String::new()
                },
                format_size(self.largest_free_block)
            );
        }
        if let Some(cap) = self.cap {
            if self.device_free >= self.requested && cap < self.device_total {
                return format!(
                    "the device still has {} free, but gpumem is capped at {}: raise the cap \
                     (GPUMEM_CONF=fraction:…) or preallocate more.",
                    format_size(self.device_free),
                    format_size(cap)
                );
            }
        }
        if self.device_free < self.requested && self.held < self.device_total / 2 {
            return format!(
                "gpumem holds only {} of the device's {} and the rest is not free: most of the \
                 device is held by someone else (another process or allocator): check \
                 `gpumem monitor` or nvidia-smi.",
                format_size(self.held),
                format_size(self.device_total)
            );
        }
        "live tensors fill the memory: free references you no longer need, reduce the batch \
         size, or use activation checkpointing."
            .to_string()
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of memory: tried to allocate {} on stream {:#x} (policy {}). The device has {} \
             in total, of which {} is free{}. gpumem holds {}: {} allocated to live tensors and \
             {} cached (reserved but unallocated: {:.1}% of held); the largest free block is {}. {} retr{} after releasing \
             the cache. Suggestion: {}",
            format_size(self.requested),
            self.stream,
            self.policy,
            format_size(self.device_total),
            format_size(self.device_free),
            match self.cap {
                Some(c) => format!("; gpumem may hold at most {}", format_size(c)),
                None => String::new(),
            },
            format_size(self.held),
            format_size(self.allocated),
            format_size(self.cached),
            100.0 * self.fragmentation(),
            format_size(self.largest_free_block),
            self.retries,
            if self.retries == 1 { "y" } else { "ies" },
            self.suggestion()
        )
    }
}

/// Errors of the allocator's public operations.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AllocError {
    /// No memory could be found for a request, even after releasing the cache.
    #[error("{0}")]
    OutOfMemory(Box<OomReport>),
    /// A size of zero, or one no device could hold.
    #[error("invalid size {size} bytes: {reason}")]
    InvalidSize {
        /// The size that was asked for.
        size: u64,
        /// Why it was refused.
        reason: String,
    },
    /// The pointer was never handed out by this allocator (or was already returned and its
    /// block is gone).
    #[error("pointer {ptr:#x} was not allocated by this gpumem allocator (foreign pointer, or freed twice)")]
    UnknownPointer {
        /// The pointer given.
        ptr: u64,
    },
    /// The pointer is the start of a block that is already free. Almost always a second free;
    /// telling that apart from a pointer never handed out that happens to start a free block
    /// (the free rest of a split block) would need a record of past frees on the free path.
    #[error(
        "double free: pointer {ptr:#x} starts a block that is already free (freed before, or \
         never handed out)"
    )]
    DoubleFree {
        /// The pointer given.
        ptr: u64,
    },
    /// The device (driver or simulation) refused a call.
    #[error("device error: {0}")]
    Backend(#[from] BackendError),
    /// The one stream handle gpumem reserves (`u64::MAX`, -1 as a signed integer).
    #[error("stream handle {stream:#x} is reserved (-1 is not a stream)")]
    ReservedStream {
        /// The handle given.
        stream: u64,
    },
    /// More distinct streams than the allocator's stream table holds.
    #[error("too many streams: gpumem keeps at most {limit} streams per device")]
    TooManyStreams {
        /// The table's capacity.
        limit: usize,
    },
    /// A configuration value was not understood.
    #[error("configuration error: {0}")]
    Config(String),
    /// A private pool (CUDA graph memory) was misused: an unknown pool, one ended or released
    /// more often than begun, two captures into one pool at once.
    #[error("private pool error: {0}")]
    Pool(String),
}

impl AllocError {
    /// True for out-of-memory errors.
    pub fn is_oom(&self) -> bool {
        matches!(self, AllocError::OutOfMemory(_))
    }
}

/// Errors reading an allocation trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file ended in the middle of a record.
    #[error("trace is truncated: {0}")]
    Truncated(String),
    /// The content does not have the expected shape.
    #[error("malformed trace at byte {offset}: {what}")]
    Malformed {
        /// Byte offset in the (decompressed) stream where the problem was seen.
        offset: u64,
        /// What was wrong.
        what: String,
    },
    /// The events are individually readable but describe something impossible.
    #[error("inconsistent trace at event {index}: {what}")]
    Inconsistent {
        /// Index of the offending event.
        index: usize,
        /// What was wrong.
        what: String,
    },
    /// The format was not recognised.
    #[error("unrecognised trace format: {0}")]
    UnknownFormat(String),
}
