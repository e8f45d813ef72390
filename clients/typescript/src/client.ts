// The typed client over the generated RegistryService, and once(): the Go
// client's Once for TypeScript (client/once.go and client/run.go say the
// same in Go).
import { create } from "@bufbuild/protobuf";
import { durationFromMs, durationMs } from "@bufbuild/protobuf/wkt";
import { Code, createClient, type CallOptions, type Client, type Transport } from "@connectrpc/connect";
import { ErrorReason } from "./gen/idemreg/v1/error_reason_pb.js";
import {
  Kind,
  Outcome,
  RegistryService,
  ResultSchema,
  type ClaimResponse,
  type Record,
  type Result,
} from "./gen/idemreg/v1/registry_pb.js";
import {
  FinalError,
  InProgressError,
  IdemregError,
  NotRecordedError,
  ParkedError,
  StoredFailureError,
  UnavailableError,
  fromError,
  isReason,
} from "./errors.js";

/** A registry key: (consumer, kind, key). */
export interface Key {
  consumer: string;
  /** Kind.MESSAGE by default (Kind.OPERATION for an outgoing call's key). */
  kind?: Kind;
  key: string;
}

/** What Complete, Release and Extend need of a claim: its token and secret. */
export interface Fence {
  token: bigint;
  claimSecret: Uint8Array;
}

/** The claim a once() handler runs under. */
export interface Attempt {
  key: Required<Key>;
  /** The fencing token: larger than every earlier holder's. Make the effect conditional on it. */
  token: bigint;
  /** 1 for the first holder; above 1 an earlier holder's lease ran out or it released. */
  attempt: bigint;
  /**
   * Aborted when the registry reports the claim lost (another holder took
   * over, or the attempt reached its consumer's max_lease_total); its
   * reason is the IdemregError (LEASE_LOST, LEASE_TOTAL_EXCEEDED, ...).
   */
  signal: AbortSignal;
}

/** How once() stores a handler's value: a type name and bytes. */
export interface Codec<T> {
  type: string;
  encode(value: T): Uint8Array;
  decode(data: Uint8Array): T;
}

/**
 * JSON, stored with the type "application/json": once()'s default. A
 * replay's value is what JSON.parse returns, not the handler's value: a
 * Date comes back as its ISO string, a Map as {}, undefined fields are
 * gone, a bigint cannot be stored at all. once<T>() still types it T; for
 * a T that JSON does not round-trip, pass jsonCodecOf(revive).
 */
export const jsonCodec: Codec<unknown> = {
  type: "application/json",
  encode: (v) => new TextEncoder().encode(JSON.stringify(v ?? null)),
  decode: (b) => (b.length === 0 ? undefined : JSON.parse(new TextDecoder().decode(b))),
};

/**
 * A JSON codec whose replays are T: revive turns what JSON.parse returns
 * back into a T (a Date from its string, a class from its fields), and
 * is given the stored JSON of every replay. Stored as jsonCodec stores, so
 * records written with either replay with either.
 *
 *   const atCodec = jsonCodecOf((j: any) => ({ ...j, at: new Date(j.at) }));
 *   const res = await reg.once(k, async () => ({ at: new Date() }), { codec: atCodec });
 *   res.value.at instanceof Date; // on a replay too
 *
 * reviver, when given, is JSON.parse's second argument, applied first.
 */
export function jsonCodecOf<T>(revive: (json: unknown) => T, reviver?: (key: string, value: unknown) => unknown): Codec<T> {
  return {
    type: jsonCodec.type,
    encode: (v) => jsonCodec.encode(v),
    decode: (b) => revive(b.length === 0 ? undefined : JSON.parse(new TextDecoder().decode(b), reviver)),
  };
}

/** Bytes as they are, with no type: what the Go client's Once stores. */
export const bytesCodec: Codec<Uint8Array> = {
  type: "",
  encode: (v) => v ?? new Uint8Array(),
  decode: (b) => b,
};

export interface OnceOptions<T> {
  /** The lease to claim and extend by; 30 s by default. It is extended every half lease while the handler runs. */
  leaseMs?: number;
  /** How long the record is kept after completion; the registry's default for the kind when absent. */
  retentionMs?: number;
  /** A hash of the message's content (at most 64 bytes): the same key with another fingerprint is refused. */
  fingerprint?: Uint8Array;
  /**
   * Wait, at most this long, for another holder's outcome instead of
   * throwing InProgressError at once (the Go client's
   * WithInProgressWait). The registry holds each Claim up to 30 s.
   */
  waitMs?: number;
  /** Bounds the Complete or Release after the handler; 5 s by default. */
  bookkeepingTimeoutMs?: number;
  /**
   * How the handler's value is stored and replayed; jsonCodec by default,
   * whose replays are JSON.parse's value whatever T says (a Date comes
   * back a string): jsonCodecOf(revive) replays a T.
   */
  codec?: Codec<T>;
  /** Cancels the claim (and the handler's signal). */
  signal?: AbortSignal;
}

export interface OnceResult<T> {
  /** The handler ran in this call. */
  ran: boolean;
  /**
   * The key was already completed: value is the stored one, decoded by the
   * codec (with the default, JSON.parse's value), and the handler did not
   * run.
   */
  replayed: boolean;
  value: T;
  /** The registry's record after the call. */
  record?: Record;
}

export const DefaultLeaseMs = 30_000;
export const DefaultBookkeepingTimeoutMs = 5_000;
/** The longest the registry holds one Claim for another holder (ClaimRequest.wait). */
export const MaxWaitMs = 30_000;
/** How many times a Claim whose answer was lost is repeated, with its request id. */
const claimRepeats = 3;

const lostReasons = new Set<ErrorReason>([
  ErrorReason.LEASE_LOST,
  ErrorReason.NOT_FOUND,
  ErrorReason.ALREADY_COMPLETED,
  ErrorReason.LEASE_TOTAL_EXCEEDED,
  ErrorReason.CLAIM_SECRET_INVALID,
]);

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const t = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(t);
      reject(signal?.reason);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

function newRequestId(): string {
  const b = new Uint8Array(16);
  crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

function fullKey(k: Key): Required<Key> {
  return { consumer: k.consumer, kind: k.kind ?? Kind.MESSAGE, key: k.key };
}

/**
 * The registry's client. Every method throws the typed errors of
 * errors.ts. The transport is yours: createGrpcTransport from
 * @connectrpc/connect-node (see node.ts), or connect-web's in a browser.
 */
export class RegistryClient {
  readonly rpc: Client<typeof RegistryService>;
  private readonly holder: string;

  constructor(transport: Transport, opts: { holder?: string } = {}) {
    this.rpc = createClient(RegistryService, transport);
    this.holder = opts.holder ?? "";
  }

  private async call<R>(f: () => Promise<R>): Promise<R> {
    try {
      return await f();
    } catch (e) {
      throw fromError(e);
    }
  }

  /** Claim a key. An IN_PROGRESS or PARKED outcome is an answer here, not an error. */
  claim(
    k: Key,
    p: { fingerprint?: Uint8Array; leaseMs?: number; retentionMs?: number; requestId?: string; waitMs?: number } = {},
    opts?: CallOptions,
  ): Promise<ClaimResponse> {
    const key = fullKey(k);
    return this.call(() =>
      this.rpc.claim(
        {
          ...key,
          fingerprint: p.fingerprint ?? new Uint8Array(),
          lease: p.leaseMs ? durationFromMs(p.leaseMs) : undefined,
          retention: p.retentionMs ? durationFromMs(p.retentionMs) : undefined,
          holder: this.holder,
          requestId: p.requestId ?? "",
          wait: p.waitMs ? durationFromMs(p.waitMs) : undefined,
        },
        opts,
      ),
    );
  }

  /** Store a result (a response, or a final failure) under the claim's fence. */
  async complete(k: Key, f: Fence, result: Result, opts?: CallOptions): Promise<Record | undefined> {
    const res = await this.call(() => this.rpc.complete({ ...fullKey(k), token: f.token, claimSecret: f.claimSecret, result }, opts));
    return res.record;
  }

  /** Give the key back so that a retry can claim it. */
  async release(k: Key, f: Fence, opts?: CallOptions): Promise<Record | undefined> {
    const res = await this.call(() => this.rpc.release({ ...fullKey(k), token: f.token, claimSecret: f.claimSecret }, opts));
    return res.record;
  }

  /** Renew the claim's lease. */
  async extend(k: Key, f: Fence, leaseMs: number, opts?: CallOptions): Promise<Record | undefined> {
    const res = await this.call(() =>
      this.rpc.extend({ ...fullKey(k), token: f.token, claimSecret: f.claimSecret, lease: durationFromMs(leaseMs) }, opts),
    );
    return res.record;
  }

  /** Set the key aside for an operator. */
  async park(k: Key, f: Fence, reason: string, opts?: CallOptions): Promise<Record | undefined> {
    const res = await this.call(() => this.rpc.park({ ...fullKey(k), token: f.token, claimSecret: f.claimSecret, reason }, opts));
    return res.record;
  }

  /** The key's live record; NOT_FOUND when it has none. */
  async lookup(k: Key, opts?: CallOptions): Promise<Record | undefined> {
    const res = await this.call(() => this.rpc.lookup(fullKey(k), opts));
    return res.record;
  }

  /**
   * Runs handler at most once to completion per key, and gives every
   * duplicate the stored outcome, as the Go client's Once:
   *
   * - acquired: handler runs with the fencing token; the lease is extended
   *   every half lease while it runs, and attempt.signal is aborted should
   *   the registry report the claim lost. Its value is stored (ran); a
   *   final(err) it throws is stored and rethrown; anything else it throws
   *   releases the key for a retry and is rethrown;
   * - completed: handler does not run; the stored value (replayed), or the
   *   stored failure thrown as a StoredFailureError;
   * - in progress elsewhere: InProgressError, or with waitMs the outcome
   *   once it is stored (or the handler runs, after a takeover);
   * - parked: ParkedError;
   * - registry unreachable: UnavailableError (after three tries with the
   *   same request id, which gets a lost answer's claim back).
   */
  async once<T = unknown>(k: Key, handler: (a: Attempt) => Promise<T>, opts: OnceOptions<T> = {}): Promise<OnceResult<T>> {
    const key = fullKey(k);
    const codec = (opts.codec ?? jsonCodec) as Codec<T>;
    const leaseMs = opts.leaseMs ?? DefaultLeaseMs;
    const cl = await this.claimForOnce(key, leaseMs, opts);
    switch (cl.outcome) {
      case Outcome.COMPLETED:
        return replay(cl.record, codec);
      case Outcome.PARKED:
        throw new ParkedError(cl.record!);
      case Outcome.ACQUIRED:
        return this.run(key, cl, handler, codec, leaseMs, opts);
      default:
        throw new IdemregError(`idemreg: unexpected claim outcome ${Outcome[cl.outcome]}`, { code: Code.Internal });
    }
  }

  private async claimForOnce<T>(key: Required<Key>, leaseMs: number, opts: OnceOptions<T>): Promise<ClaimResponse> {
    const requestId = newRequestId();
    const until = opts.waitMs ? Date.now() + opts.waitMs : 0;
    let repeats = 0;
    let backoff = 50;
    for (;;) {
      const left = until ? until - Date.now() : 0;
      let cl: ClaimResponse;
      try {
        cl = await this.claim(
          key,
          { fingerprint: opts.fingerprint, leaseMs, retentionMs: opts.retentionMs, requestId, waitMs: left > 0 ? Math.min(left, MaxWaitMs) : 0 },
          { signal: opts.signal, timeoutMs: DefaultBookkeepingTimeoutMs + Math.max(left, 0) },
        );
      } catch (e) {
        const err = fromError(e);
        const again = err instanceof UnavailableError || err.code === Code.DeadlineExceeded;
        if (again && repeats < claimRepeats && !opts.signal?.aborted) {
          repeats++;
          await sleep(Math.max(backoff, err.retryAfterMs), opts.signal);
          backoff = Math.min(2 * backoff, 1000);
          continue;
        }
        throw err;
      }
      if (cl.outcome !== Outcome.IN_PROGRESS) {
        return cl;
      }
      const retryAfterMs = cl.retryAfter ? durationMs(cl.retryAfter) : 1000;
      if (!until || Date.now() >= until) {
        throw new InProgressError(retryAfterMs);
      }
      // The registry's wait ended without an outcome: try again, never
      // sleeping past the holder's lease.
      await sleep(Math.min(backoff, retryAfterMs, Math.max(until - Date.now(), 0)), opts.signal);
      backoff = Math.min(2 * backoff, 1000);
    }
  }

  private async run<T>(
    key: Required<Key>,
    cl: ClaimResponse,
    handler: (a: Attempt) => Promise<T>,
    codec: Codec<T>,
    leaseMs: number,
    opts: OnceOptions<T>,
  ): Promise<OnceResult<T>> {
    const fence: Fence = { token: cl.token, claimSecret: cl.claimSecret };
    const work = new AbortController();
    const onOuterAbort = () => work.abort(opts.signal?.reason);
    opts.signal?.addEventListener("abort", onOuterAbort, { once: true });
    let lost: IdemregError | undefined;
    const beat = new AbortController();
    const heartbeat = (async () => {
      for (;;) {
        try {
          await sleep(leaseMs / 2, beat.signal);
        } catch {
          return;
        }
        try {
          await this.extend(key, fence, leaseMs, { signal: beat.signal, timeoutMs: leaseMs / 2 });
        } catch (e) {
          const err = fromError(e);
          if ([...lostReasons].some((r) => isReason(err, r))) {
            lost = err;
            work.abort(err);
            return;
          }
          // Anything else (the registry briefly unreachable) is retried at
          // the next beat: the lease has half its length left.
        }
      }
    })();
    const stop = async () => {
      beat.abort();
      await heartbeat;
      opts.signal?.removeEventListener("abort", onOuterAbort);
    };
    const bookkeeping = { timeoutMs: opts.bookkeepingTimeoutMs ?? DefaultBookkeepingTimeoutMs };

    let value: T;
    try {
      value = await handler({ key, token: cl.token, attempt: cl.record?.attempt ?? 1n, signal: work.signal });
    } catch (e) {
      await stop();
      if (e instanceof FinalError) {
        const failure = create(ResultSchema, { outcome: { case: "failure", value: { code: e.code, message: e.message } } });
        try {
          await this.completeRetrying(key, fence, failure, bookkeeping);
        } catch (ce) {
          throw new AggregateError([e, ce], `idemreg: the final failure was not recorded: ${fromError(ce).message}`);
        }
        throw e;
      }
      // A claim taken over is someone else's now: nothing to release.
      if (!lost || isReason(lost, ErrorReason.LEASE_TOTAL_EXCEEDED)) {
        await this.release(key, fence, bookkeeping).catch(() => {
          // The key frees itself when its lease ends.
        });
      }
      throw e;
    }
    await stop();
    const result = create(ResultSchema, { outcome: { case: "response", value: { type: codec.type, data: codec.encode(value) } } });
    let record: Record | undefined;
    try {
      record = await this.completeRetrying(key, fence, result, bookkeeping);
    } catch (ce) {
      throw new NotRecordedError(value, lost ?? ce);
    }
    return { ran: true, replayed: false, value, record };
  }

  // completeRetrying stores r, repeating while the registry is unavailable
  // (a Complete repeated with its token is safe), within the timeout.
  private async completeRetrying(key: Required<Key>, f: Fence, r: Result, opts: { timeoutMs: number }): Promise<Record | undefined> {
    const until = Date.now() + opts.timeoutMs;
    let backoff = 50;
    for (;;) {
      try {
        return await this.complete(key, f, r, { timeoutMs: Math.max(until - Date.now(), 1) });
      } catch (e) {
        const err = fromError(e);
        if (!(err instanceof UnavailableError) || Date.now() + backoff >= until) {
          throw err;
        }
        await sleep(Math.max(backoff, err.retryAfterMs));
        backoff = Math.min(2 * backoff, 1000);
      }
    }
  }
}

function replay<T>(record: Record | undefined, codec: Codec<T>): OnceResult<T> {
  const o = record?.result?.outcome;
  switch (o?.case) {
    case "response":
      return { ran: false, replayed: true, value: codec.decode(o.value.data), record };
    case "failure":
      throw new StoredFailureError(o.value.message, o.value.code as Code);
    default:
      throw new IdemregError("idemreg: completed record without a result", { code: Code.Internal });
  }
}
