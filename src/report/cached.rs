//! Which outstanding CUDA memory belongs to a known caching allocator.
//!
//! At exit PyTorch's caching allocator still holds the segments it cached, and
//! TensorFlow's BFC allocator its regions: that memory is not lost, it was never given
//! back to the driver on purpose. The rule: a group of device, managed, pinned or VMM
//! memory whose call stack has a frame whose (demangled) function name contains one of
//! the markers below is `cached_by` that allocator. Host memory is never classified
//! this way, nor are mappings and Python objects. With `PYTORCH_NO_CUDA_MEMORY_CACHING=1` PyTorch calls `cudaMalloc` and
//! `cudaFree` once per tensor, and each leaked tensor shows with its own stack.
use super::build::Frame;
use crate::hotpath::event::Kind;

/// (substring of a function name, the allocator reported).
pub const MARKERS: &[(&str, &str)] = &[
    ("c10::cuda::CUDACachingAllocator", "PyTorch CUDACachingAllocator"),
    ("CachingHostAllocator", "PyTorch CachingHostAllocator"),
    ("BFCAllocator", "TensorFlow BFCAllocator"),
    ("GpuCudaMallocAsyncAllocator", "TensorFlow GpuCudaMallocAsyncAllocator"),
];

pub fn owner(kind: Kind, stack: &[Frame]) -> Option<&'static str> {
    // Host memory, the program's own mappings and Python objects never are (a CUDA
    // library's mappings under `cudaMalloc` are its own, not the cache's).
    if matches!(kind, Kind::Host | Kind::Mmap | Kind::Python) {
        return None;
    }
    stack.iter().filter_map(|f| f.function.as_deref()).find_map(|name| MARKERS.iter().find(|(marker, _)| name.contains(marker)).map(|(_, owner)| *owner))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str) -> Frame {
        Frame { ip: 1, module: None, offset: None, function: Some(function.into()), file: None, line: None, inlined: false, python: false }
    }

    #[test]
    fn known_allocators_are_recognised_on_device_memory_only() {
        let torch = [
            frame("cudaMalloc"),
            frame("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)"),
            frame("main"),
        ];
        assert_eq!(owner(Kind::Device, &torch), Some("PyTorch CUDACachingAllocator"));
        assert_eq!(owner(Kind::Host, &torch), None);
        assert_eq!(
            owner(Kind::Pinned, &[frame("at::cuda::(anonymous namespace)::CachingHostAllocatorImpl::allocate_host_memory(unsigned long, void**)")]),
            Some("PyTorch CachingHostAllocator")
        );
        assert_eq!(owner(Kind::Mapping, &[frame("tsl::BFCAllocator::Extend(unsigned long, unsigned long)")]), Some("TensorFlow BFCAllocator"));
        assert_eq!(owner(Kind::Device, &[frame("train_step"), frame("main")]), None);
        assert_eq!(owner(Kind::Device, &[]), None);
    }
}
