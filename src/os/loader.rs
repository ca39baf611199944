//! The loader's module list, walked never across a fork.

/// Our own walks of the loader's module list (`dl_iterate_phdr`). glibc holds the
/// loader's write lock while it calls back, and a fork at that moment leaves the lock
/// held in the child for good (glibc does not reset it), so the child's next walk — the
/// scan of its final report — never returns. The fork `prepare` handler takes this
/// lock first: no walk of ours is under way across a fork.
static LOADER_WALKS: super::lock::SpinLock<()> = super::lock::SpinLock::new(());

extern "C" {
    /// glibc's `dladdr1` (not in the libc crate): `dladdr`, plus in `extra` the
    /// symbol's `ElfW(Sym)` (`RTLD_DL_SYMENT`) or the module's `link_map`
    /// (`RTLD_DL_LINKMAP`).
    pub fn dladdr1(addr: *const std::ffi::c_void, info: *mut libc::Dl_info, extra: *mut *mut std::ffi::c_void, flags: std::ffi::c_int) -> std::ffi::c_int;
}
pub const RTLD_DL_SYMENT: std::ffi::c_int = 1;
pub const RTLD_DL_LINKMAP: std::ffi::c_int = 2;

/// The address of `name` as the program sees it (`dlsym(RTLD_DEFAULT)`), if defined.
/// Most names asked at the start are defined nowhere (a sanitizer's, Go's, Python's in
/// a program without them): those are answered from the modules' own tables, without
/// the failed `dlsym` and the error message it formats.
pub fn global_symbol(name: &std::ffi::CStr) -> Option<usize> {
    global_symbols([name])[0]
}

/// `global_symbol` of each of `names`, the modules' tables read in one walk.
pub fn global_symbols<const N: usize>(names: [&std::ffi::CStr; N]) -> [Option<usize>; N] {
    let nowhere = super::elf::each_defined_nowhere(names);
    let mut out = [None; N];
    for ((name, nowhere), out) in names.iter().zip(nowhere).zip(out.iter_mut()) {
        if !nowhere {
            // SAFETY: dlsym with a valid handle and a NUL-terminated name.
            let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
            *out = (p != 0).then_some(p);
        }
    }
    out
}

/// A lookup like `global_symbol` that answers `names` from `found` (their
/// `global_symbols`, one walk of the modules' tables at a start that asks after several
/// names most programs lack) and looks any other name up as asked.
pub fn global_symbols_or_lookup<const N: usize>(names: [&'static std::ffi::CStr; N], found: [Option<usize>; N]) -> impl Fn(&std::ffi::CStr) -> Option<usize> {
    move |name| names.iter().position(|n| *n == name).map_or_else(|| global_symbol(name), |i| found[i])
}

/// The C library's or the loader's own definition of each of `names` (what our module's
/// `dlsym(RTLD_NEXT)` finds: the first module after this library that defines it, or
/// failing that the first one before it), from the modules' tables: a `dlsym` was a
/// few microseconds of every process's start. The loader answers where the tables
/// cannot tell (an IFUNC, a hidden version only).
pub fn library_symbols<const N: usize>(names: [&std::ffi::CStr; N]) -> [Option<usize>; N] {
    let found = super::elf::next_definitions_found(names, library_symbols::<N> as *const () as usize);
    std::array::from_fn(|i| match found[i] {
        super::elf::Found::At(p) => Some(p),
        super::elf::Found::Nowhere => None,
        super::elf::Found::Unknown => global_symbol(names[i]),
    })
}

/// A `dl_iterate_phdr` callback.
pub type ModuleVisitor = unsafe extern "C" fn(*mut libc::dl_phdr_info, usize, *mut std::ffi::c_void) -> std::ffi::c_int;

/// `dl_iterate_phdr`, never across a fork. A walk inside one of this thread's walks
/// (a first allocation in a callback reaching a `malloc` that resolves itself through
/// `dlvsym`, which asks which module called) goes ahead under the lock already held:
/// the loader's own lock is recursive.
///
/// # Safety
/// As `dl_iterate_phdr`: `callback` must treat `data` as what the caller passes.
pub unsafe fn iterate_modules(callback: Option<ModuleVisitor>, data: *mut std::ffi::c_void) -> std::ffi::c_int {
    if LOADER_WALKS.held_by_me() {
        // SAFETY: forwarded under the caller's contract.
        return unsafe { libc::dl_iterate_phdr(callback, data) };
    }
    let _walk = LOADER_WALKS.lock();
    // SAFETY: forwarded under the caller's contract.
    unsafe { libc::dl_iterate_phdr(callback, data) }
}

/// How many modules the loader has unloaded so far (`dl_phdr_info::dlpi_subs`), or
/// `None` where it does not say.
pub fn unloads() -> Option<u64> {
    unsafe extern "C" fn first_module(info: *mut libc::dl_phdr_info, size: usize, data: *mut std::ffi::c_void) -> std::ffi::c_int {
        // The count is there only in a large enough structure (glibc 2.4 on).
        if size >= std::mem::offset_of!(libc::dl_phdr_info, dlpi_subs) + std::mem::size_of::<u64>() {
            // SAFETY: `data` is the `Option<u64>` passed below; `info` is the loader's,
            // valid during the call, and `size` covers the field read.
            unsafe { *(data as *mut Option<u64>) = Some((*info).dlpi_subs) };
        }
        1
    }
    let mut out: Option<u64> = None;
    // SAFETY: the callback writes only the `Option<u64>` it is given, and stops the walk
    // at the first module.
    unsafe { iterate_modules(Some(first_module), &mut out as *mut Option<u64> as *mut std::ffi::c_void) };
    out
}

/// Fork `prepare`: waits for our walks of the module list to end and holds off new ones.
pub fn fork_hold_loader_walks() {
    LOADER_WALKS.lock_raw();
}

/// Fork `parent` / `child`: walks may start again.
pub fn fork_release_loader_walks() {
    LOADER_WALKS.unlock_raw();
}

/// The dynamic loader's executable segment, `[lo, hi)` (0, 0 until noted, or where the
/// loader is the program itself: `ld.so ./prog`).
static LOADER_TEXT: [std::sync::atomic::AtomicUsize; 2] = [std::sync::atomic::AtomicUsize::new(0), std::sync::atomic::AtomicUsize::new(0)];

/// Notes where the dynamic loader's code lies, from its ELF header at `AT_BASE` (no
/// system call, no lock, no allocation).
pub fn note_dynamic_loader_text() {
    use std::sync::atomic::Ordering;
    // SAFETY: getauxval has no preconditions.
    let base = unsafe { libc::getauxval(libc::AT_BASE) } as usize;
    if base == 0 {
        return;
    }
    // SAFETY: AT_BASE is where the kernel mapped the interpreter, whose first page (its
    // ELF header, program headers following) stays mapped and readable for the process's
    // life.
    let (lo, hi) = unsafe {
        let eh = &*(base as *const libc::Elf64_Ehdr);
        if &eh.e_ident[..4] != b"\x7fELF" || eh.e_phentsize as usize != std::mem::size_of::<libc::Elf64_Phdr>() {
            return;
        }
        let phdrs = std::slice::from_raw_parts((base + eh.e_phoff as usize) as *const libc::Elf64_Phdr, eh.e_phnum as usize);
        phdrs.iter().filter(|ph| ph.p_type == libc::PT_LOAD && ph.p_flags & libc::PF_X != 0).fold((usize::MAX, 0), |(lo, hi), ph| {
            let start = base + ph.p_vaddr as usize;
            (lo.min(start), hi.max(start + ph.p_memsz as usize))
        })
    };
    if lo < hi {
        LOADER_TEXT[0].store(lo, Ordering::Relaxed);
        LOADER_TEXT[1].store(hi, Ordering::Relaxed);
    }
}

/// Whether `ip` lies in the dynamic loader's code (as noted by `note_dynamic_loader_text`).
pub fn in_dynamic_loader(ip: usize) -> bool {
    use std::sync::atomic::Ordering;
    ip >= LOADER_TEXT[0].load(Ordering::Relaxed) && ip < LOADER_TEXT[1].load(Ordering::Relaxed)
}

/// The lowest and highest address of a module's PT_LOAD segments.
pub fn span(base: usize, phdrs: &[libc::Elf64_Phdr]) -> (usize, usize) {
    phdrs.iter().filter(|ph| ph.p_type == libc::PT_LOAD).fold((usize::MAX, 0), |(lo, hi), ph| {
        let start = base + ph.p_vaddr as usize;
        (lo.min(start), hi.max(start + ph.p_memsz as usize))
    })
}

/// Where a module's dynamic section (PT_DYNAMIC) is mapped, if it has one.
pub fn dynamic_section(base: usize, phdrs: &[libc::Elf64_Phdr]) -> Option<usize> {
    phdrs.iter().find(|ph| ph.p_type == libc::PT_DYNAMIC).map(|ph| base + ph.p_vaddr as usize)
}

/// A loaded ELF module: its path as the loader knows it (empty for the main program)
/// and the span of its PT_LOAD segments.
pub struct LoadedModule {
    pub path: std::ffi::CString,
    /// Load bias: file virtual address = runtime address - base.
    pub base: usize,
    pub lo: usize,
    pub hi: usize,
    /// Its dynamic section (PT_DYNAMIC) as mapped; 0 for none.
    pub dynamic: usize,
}

/// Every loaded module, in load order.
pub fn loaded_modules() -> Vec<LoadedModule> {
    extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, data: *mut std::ffi::c_void) -> std::ffi::c_int {
        // SAFETY: the loader passes a valid info; data is our Vec.
        unsafe {
            let out = &mut *(data as *mut Vec<LoadedModule>);
            let i = &*info;
            let phdrs = std::slice::from_raw_parts(i.dlpi_phdr, i.dlpi_phnum as usize);
            let (lo, hi) = span(i.dlpi_addr as usize, phdrs);
            let dynamic = dynamic_section(i.dlpi_addr as usize, phdrs).unwrap_or(0);
            let path = if i.dlpi_name.is_null() { std::ffi::CString::default() } else { std::ffi::CStr::from_ptr(i.dlpi_name).to_owned() };
            if lo < hi {
                out.push(LoadedModule { path, base: i.dlpi_addr as usize, lo, hi, dynamic });
            }
        }
        0
    }
    let mut out: Vec<LoadedModule> = Vec::new();
    // SAFETY: the callback only reads what the loader gives it.
    unsafe { iterate_modules(Some(visit), &mut out as *mut Vec<LoadedModule> as *mut std::ffi::c_void) };
    out
}

/// How many modules the loader has added since the process started (`dlpi_adds`): a
/// change means a module was loaded since the last call.
pub fn modules_added() -> u64 {
    extern "C" fn first(info: *mut libc::dl_phdr_info, _size: usize, data: *mut std::ffi::c_void) -> std::ffi::c_int {
        // SAFETY: the loader passes a valid info (glibc's, which has dlpi_adds); data is our u64.
        unsafe { *(data as *mut u64) = (*info).dlpi_adds };
        1
    }
    let mut adds = 0u64;
    // SAFETY: the callback writes one u64 through the pointer it is given.
    unsafe { iterate_modules(Some(first), &mut adds as *mut u64 as *mut std::ffi::c_void) };
    adds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dynamic_loaders_code_is_found_and_ours_is_not_in_it() {
        note_dynamic_loader_text();
        // `__tls_get_addr` is the loader's own (glibc's `_dl_find_object` is in libc).
        // SAFETY: dlsym with a valid handle and a NUL-terminated name.
        let in_ldso = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__tls_get_addr".as_ptr()) } as usize;
        assert_ne!(in_ldso, 0);
        assert!(
            in_dynamic_loader(in_ldso),
            "{in_ldso:#x} not in {:#x?}",
            (LOADER_TEXT[0].load(std::sync::atomic::Ordering::Relaxed), LOADER_TEXT[1].load(std::sync::atomic::Ordering::Relaxed))
        );
        assert!(!in_dynamic_loader(note_dynamic_loader_text as *const () as usize));
        assert!(!in_dynamic_loader(libc::malloc as *const () as usize));
    }
}
