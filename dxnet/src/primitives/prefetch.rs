//! Cache hints: asking this core for a line it is about to write.
//!
//! A store to a line another core last wrote, or that is not cached at
//! all, waits for the line's ownership at the next full barrier (a locked
//! instruction: a ring commit, a lock's release). Taken while other work
//! runs, the line is owned when the store comes. Hints only: they never
//! fault and change no memory, so any address is allowed.

/// Whether the CPU has `prefetchw` (CPUID 0x8000_0001, ECX bit 8); asked
/// once.
#[cfg(all(target_arch = "x86_64", not(loom)))]
fn prefetchw_supported() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static KNOWN: AtomicU8 = AtomicU8::new(0);
    match KNOWN.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            // Leaf 0x8000_0001 exists when the highest extended leaf
            // reaches it.
            let has = std::arch::x86_64::__cpuid(0x8000_0000).eax >= 0x8000_0001
                && std::arch::x86_64::__cpuid(0x8000_0001).ecx & (1 << 8) != 0;
            KNOWN.store(if has { 2 } else { 1 }, Ordering::Relaxed);
            has
        }
    }
}

/// Asks for the cache lines of `lines` for writing (x86 `prefetchw`; a
/// no-op elsewhere, under loom, or on CPUs without it).
#[inline]
pub fn for_write(lines: impl IntoIterator<Item = *const u8>) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    if prefetchw_supported() {
        for line in lines {
            // SAFETY: `prefetchw` reads and writes no memory and does not
            // fault, whatever the address.
            unsafe {
                std::arch::asm!(
                    "prefetchw [{0}]",
                    in(reg) line,
                    options(nostack, preserves_flags, readonly)
                );
            }
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = lines;
}
