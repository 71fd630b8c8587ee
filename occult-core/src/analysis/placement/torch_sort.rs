//! Torch's CPU `sort` (not stable), whose order of ties TensorRT-LLM's placement inherits: it is
//! libstdc++'s `std::sort` over (value, index) pairs, an introsort (median-of-three pivot,
//! unguarded partition, heap sort past the depth limit) finished by insertion sort below 16
//! elements. Written from GCC's `bits/stl_algo.h` and `bits/stl_heap.h`; the co-occurrence
//! fixture (torch's own sorts) and a hand-recorded libstdc++ run hold it to them.

/// Below this many elements the introsort leaves a range to the final insertion sort.
const THRESHOLD: usize = 16;

/// Indices of `v` ordered by value, descending, ties in the order `torch.sort(descending=True)`
/// on a CPU gives them.
pub fn argsort_desc(v: &[f32]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    sort_by(&mut idx, &|&a, &b| v[a] > v[b]);
    idx
}

/// `std::sort(first, last, less)`.
pub fn sort_by<T: Copy>(v: &mut [T], less: &dyn Fn(&T, &T) -> bool) {
    let n = v.len();
    if n == 0 {
        return;
    }
    let depth = 2 * (usize::BITS - 1 - n.leading_zeros()) as usize;
    introsort_loop(v, 0, n, depth, less);
    final_insertion_sort(v, less);
}

fn introsort_loop<T: Copy>(
    v: &mut [T],
    first: usize,
    mut last: usize,
    mut depth: usize,
    less: &dyn Fn(&T, &T) -> bool,
) {
    while last - first > THRESHOLD {
        if depth == 0 {
            heap_sort(&mut v[first..last], less);
            return;
        }
        depth -= 1;
        let cut = partition_pivot(v, first, last, less);
        introsort_loop(v, cut, last, depth, less);
        last = cut;
    }
}

fn partition_pivot<T: Copy>(
    v: &mut [T],
    first: usize,
    last: usize,
    less: &dyn Fn(&T, &T) -> bool,
) -> usize {
    let mid = first + (last - first) / 2;
    move_median_to_first(v, first, first + 1, mid, last - 1, less);
    unguarded_partition(v, first + 1, last, first, less)
}

fn move_median_to_first<T: Copy>(
    v: &mut [T],
    result: usize,
    a: usize,
    b: usize,
    c: usize,
    less: &dyn Fn(&T, &T) -> bool,
) {
    let pick = if less(&v[a], &v[b]) {
        if less(&v[b], &v[c]) {
            b
        } else if less(&v[a], &v[c]) {
            c
        } else {
            a
        }
    } else if less(&v[a], &v[c]) {
        a
    } else if less(&v[b], &v[c]) {
        c
    } else {
        b
    };
    v.swap(result, pick);
}

fn unguarded_partition<T: Copy>(
    v: &mut [T],
    mut first: usize,
    mut last: usize,
    pivot: usize,
    less: &dyn Fn(&T, &T) -> bool,
) -> usize {
    loop {
        while less(&v[first], &v[pivot]) {
            first += 1;
        }
        last -= 1;
        while less(&v[pivot], &v[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        v.swap(first, last);
        first += 1;
    }
}

fn final_insertion_sort<T: Copy>(v: &mut [T], less: &dyn Fn(&T, &T) -> bool) {
    if v.len() > THRESHOLD {
        insertion_sort(&mut v[..THRESHOLD], less);
        for i in THRESHOLD..v.len() {
            unguarded_linear_insert(v, i, less);
        }
    } else {
        insertion_sort(v, less);
    }
}

fn insertion_sort<T: Copy>(v: &mut [T], less: &dyn Fn(&T, &T) -> bool) {
    for i in 1..v.len() {
        if less(&v[i], &v[0]) {
            let val = v[i];
            v.copy_within(0..i, 1);
            v[0] = val;
        } else {
            unguarded_linear_insert(v, i, less);
        }
    }
}

fn unguarded_linear_insert<T: Copy>(v: &mut [T], mut last: usize, less: &dyn Fn(&T, &T) -> bool) {
    let val = v[last];
    while less(&val, &v[last - 1]) {
        v[last] = v[last - 1];
        last -= 1;
    }
    v[last] = val;
}

/// `__partial_sort(first, last, last)`: make a heap, then pop it.
fn heap_sort<T: Copy>(v: &mut [T], less: &dyn Fn(&T, &T) -> bool) {
    let len = v.len();
    if len >= 2 {
        let mut parent = (len - 2) / 2;
        loop {
            let value = v[parent];
            adjust_heap(v, parent, len, value, less);
            if parent == 0 {
                break;
            }
            parent -= 1;
        }
    }
    let mut last = len;
    while last > 1 {
        last -= 1;
        let value = v[last];
        v[last] = v[0];
        adjust_heap(v, 0, last, value, less);
    }
}

fn adjust_heap<T: Copy>(
    v: &mut [T],
    mut hole: usize,
    len: usize,
    value: T,
    less: &dyn Fn(&T, &T) -> bool,
) {
    let top = hole;
    let mut child = hole;
    while child < (len.saturating_sub(1)) / 2 {
        child = 2 * (child + 1);
        if less(&v[child], &v[child - 1]) {
            child -= 1;
        }
        v[hole] = v[child];
        hole = child;
    }
    if len & 1 == 0 && len >= 2 && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        v[hole] = v[child - 1];
        hole = child - 1;
    }
    // __push_heap
    let mut parent = hole.saturating_sub(1) / 2;
    while hole > top && less(&v[parent], &value) {
        v[hole] = v[parent];
        hole = parent;
        parent = hole.saturating_sub(1) / 2;
    }
    v[hole] = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Orders libstdc++'s `std::sort` gave for values `i % 3` sorted descending by value with
    /// their indices (g++ 14; torch 2.15's `sort(descending=True)` gave the same).
    #[test]
    fn ties_fall_as_libstdcxx_leaves_them() {
        let v = |n: usize| (0..n).map(|i| (i % 3) as f32).collect::<Vec<_>>();
        assert_eq!(argsort_desc(&v(5)), vec![2, 1, 4, 0, 3]);
        assert_eq!(
            argsort_desc(&v(32)),
            vec![
                2, 29, 5, 26, 8, 23, 11, 20, 14, 17, 16, 31, 28, 25, 22, 19, 13, 10, 7, 4, 1, 0,
                15, 18, 12, 21, 9, 24, 6, 27, 3, 30
            ]
        );
        assert_eq!(
            argsort_desc(&v(64))[..16],
            [47, 32, 29, 35, 26, 38, 23, 41, 20, 44, 17, 14, 50, 56, 62, 2]
        );
    }

    /// Sorted, whatever the input (the heap path too: a depth of 0 forces it).
    #[test]
    fn sorts_and_its_heap_path_sorts() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        for n in [0, 1, 2, 17, 100, 1000] {
            let v: Vec<u32> = (0..n).map(|_| rng.random_range(0..20)).collect();
            let mut a = v.clone();
            sort_by(&mut a, &|x, y| x < y);
            let mut b = v.clone();
            heap_sort(&mut b, &|x, y| x < y);
            let mut want = v.clone();
            want.sort_unstable();
            assert_eq!(a, want);
            assert_eq!(b, want);
        }
    }
}
