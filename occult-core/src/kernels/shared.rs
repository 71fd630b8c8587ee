//! [`Shared`]: a raw pointer the parallel tasks of a kernel share, which only read through it
//! or write disjoint elements.

/// A raw pointer shared by the parallel tasks of a kernel, which only read through it or write
/// disjoint elements. A method gives the address, so that closures capture the `Sync` wrapper
/// rather than the pointer field.
#[derive(Clone, Copy)]
pub(super) struct Shared<P>(pub(super) P);
unsafe impl<P> Send for Shared<P> {}
unsafe impl<P> Sync for Shared<P> {}

impl<T> Shared<*const T> {
    pub(super) fn at(&self, offset: usize) -> *const T {
        self.0.wrapping_add(offset)
    }
}

impl<T> Shared<*mut T> {
    pub(super) fn at(&self, offset: usize) -> *mut T {
        self.0.wrapping_add(offset)
    }
}
